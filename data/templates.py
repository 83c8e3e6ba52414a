"""Prompt templates: how a bare problem becomes the token ids a model is asked to continue.

Datasets hold bare problems; the instruction that tells the model how to present its answer lives
here, because the reward has to parse exactly that presentation:
- "answer": DAPO's training prompt; the answer comes on a last line "Answer: ...".
- "boxed":  the common math-evaluation prompt; the answer comes inside \\boxed{}.
- "plain":  a one-line instruction, for a tiny model that should reply with a number in a few tokens.
- "equation": the arithmetic demo's prompt: the bare question after one worked exchange that answers
  by restating the equation ("2 + 3 = 5"). Tiny chat models follow examples far better than
  instructions: SmolLM2-135M-Instruct ignores "answer with the number only" and explains at length,
  while after this one turn it usually answers in about ten tokens.
A template's reply ends at one of stop_ids(): where sampling stops is part of how a problem is posed.

    python data/templates.py --template boxed "What is 7 + 6?"   # the turns a model is shown
"""

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as a script: import as the data package's module (PEP 366)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "data"

from .prepare import DAPO_PREFIX, DAPO_SUFFIX  # noqa: E402

if TYPE_CHECKING:  # data/ stays importable without torch
    from model import ModelConfig

TEMPLATES = {
    "answer": DAPO_PREFIX + "{problem}" + DAPO_SUFFIX,  # DAPO-Math-17k's prompt, word for word
    "boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "plain": "{problem} Answer with the number only.",
    "equation": "{problem}",
}
# worked (question, answer) turns placed before the problem, per template
EXAMPLES = {
    "equation": [("What is 2 + 3?", "2 + 3 = 5")],
}


def user_message(problem: str, template: str) -> str:
    """The user turn: a template name from TEMPLATES, or any string containing '{problem}'."""
    text = TEMPLATES.get(template, template)
    if "{problem}" not in text:
        raise ValueError(
            f"template must be one of {', '.join(TEMPLATES)} or a string containing '{{problem}}', got {template!r}"
        )
    # replace, not str.format: templates and problems are full of LaTeX braces
    return text.replace("{problem}", problem)


def render_prompt(tokenizer, problem: str, template: str = "boxed", system: str | None = None) -> list[int]:
    """Token ids of the chat prompt for one problem, ending where the assistant's reply begins.

    Goes through tokenizer.apply_chat_template(add_generation_prompt=True). system=None keeps the
    chat template's own default system prompt (SmolLM2's default system turn is 21 tokens); a short
    system string replaces it, which matters on CPU where every prompt token is paid for G times.
    A tokenizer without a chat template (a base model) gets plain text instead: the system string
    and the user message separated by a blank line, encoded with the tokenizer's usual special
    tokens (e.g. BOS).
    """
    message = user_message(problem, template)
    if getattr(tokenizer, "chat_template", None) is None:
        text = f"{system}\n\n{message}" if system else message
        return tokenizer.encode(text)
    messages = [{"role": "system", "content": system}] if system is not None else []
    for question, answer in EXAMPLES.get(template, []):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": message})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the rendered text already carries the template's special tokens: adding BOS again would double it
    return tokenizer.encode(text, add_special_tokens=False)


def stop_ids(model_config: "ModelConfig", tokenizer) -> list[int]:
    """Token ids that end a reply: the checkpoint's end tokens (config.json may list several, e.g.
    end-of-turn and end-of-text) and the tokenizer's EOS, which for chat models is the end-of-turn token."""
    ids = model_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither the model config nor the tokenizer names an EOS token to stop sampling at")
    return sorted(ids)


def main(argv: list[str] | None = None) -> None:
    """Print the turns a template poses a problem with (system and chat formatting aside)."""
    import argparse

    parser = argparse.ArgumentParser(prog="data/templates.py", description=main.__doc__, allow_abbrev=False)
    parser.add_argument("problem", nargs="?", default="What is 7 + 6?", help="a bare problem (default: %(default)s)")
    parser.add_argument("--template", default="boxed", help=f"one of {', '.join(TEMPLATES)}, or a string with "
                                                            "{problem} (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        message = user_message(args.problem, args.template)
    except ValueError as error:
        parser.exit(2, f"data/templates.py: --template: {error}\n")
    for question, answer in EXAMPLES.get(args.template, []):
        print(f"user: {question}\nassistant: {answer}")
    print(f"user: {message}")


if __name__ == "__main__":
    main()
