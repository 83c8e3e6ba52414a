"""How many of the demo's correct answers only restate the question: the held-out set sampled as train.py's
evaluation samples it, each completion graded twice, without the problem (the checker then cannot tell an
echo: "7 + 6" to "What is 7 + 6?" counts as 13) and with it (an echo is wrong).

    python bench/echo.py                                    # the base model, the demo's evaluation settings
    python bench/echo.py --adapter runs/NAME/best           # a trained policy
    python bench/echo.py --max-new-tokens 4                 # short caps truncate "1 + 1 = 2" to "1 + 1"

Prints the correct share under each grading, the echo share of the first grading's correct samples, a few
of the echoes, and the samples only the second grading counts as correct.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import eval as evaluation  # noqa: E402
import lora  # noqa: E402
import reward  # noqa: E402
from data import load_problems  # noqa: E402
from infra import weights  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", default=None, help="default: the offline SmolLM2-135M-Instruct")
    parser.add_argument("--adapter", default=None, help="a LoRA adapter directory, e.g. runs/NAME/best")
    parser.add_argument("--dataset", default="arithmetic_test")
    parser.add_argument("--template", default="equation")
    parser.add_argument("--k", type=int, default=8, help="samples per problem (the demo's --eval-k)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = weights.from_pretrained(args.model)
    if args.adapter:
        lora.load(model, args.adapter)
    tokenizer = weights.load_tokenizer(args.model)
    problems = load_problems(args.dataset)
    results = evaluation.evaluate(
        model,
        tokenizer,
        problems,
        k=args.k,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        template=args.template,
        system="You are a helpful assistant.",
        batch_size=16,
        seed=args.seed,
    ).problems
    texts = [text for result in results for text in result.completions]
    references = [result.reference for result in results for _ in result.completions]
    questions = [p["problem"] for p in problems for _ in range(args.k)]
    blind = reward.reward(texts, references)
    seeing = reward.reward(texts, references, problems=questions, template=args.template)
    echoes = [i for i, (b, s) in enumerate(zip(blind, seeing)) if b == 1.0 and s < 1.0]
    correct = sum(score == 1.0 for score in blind)
    print(f"{len(texts)} samples ({len(problems)} problems x {args.k}, {args.max_new_tokens} new tokens)")
    print(f"correct without the problem: {correct} ({100 * correct / len(texts):.1f}%)")
    print(
        f"correct with the problem:    {int(sum(s == 1.0 for s in seeing))} "
        f"({100 * sum(s == 1.0 for s in seeing) / len(texts):.1f}%)"
    )
    print(
        f"echoes: {len(echoes)} of the {correct} correct without the problem "
        f"({100 * len(echoes) / max(correct, 1):.1f}%)"
    )
    for i in echoes[:8]:
        print(f"  {questions[i]!r} -> {texts[i]!r}")
    gained = [i for i, (b, s) in enumerate(zip(blind, seeing)) if b < 1.0 and s == 1.0]
    print(f"correct only with the problem (the equation template's answer follows the last '='): {len(gained)}")
    for i in gained[:8]:
        print(f"  {questions[i]!r} -> {texts[i]!r}")


if __name__ == "__main__":
    main()
