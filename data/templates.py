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
- "code": a programming problem; the program comes in a ```python block, which grading/sandbox.py runs against the
  problem's tests. Its worked exchange (a chat model sees it; a base model gets the instruction alone) is one
  such program, which a 135M model needs to answer in code at all.
A template's reply ends at one of stop_ids(): where sampling stops is part of how a problem is posed.

Thinking mode: Qwen3's chat template opens a <think> block unless it is rendered with
enable_thinking=False, which writes an empty thought into the prompt instead. render_prompt passes the
switch to every template (one that does not read it ignores it); thinking_note says in one line when
the switch cannot act, and opens_thought whether a prompt leaves a thought open for the completion.

    python data/templates.py --template boxed "What is 7 + 6?"   # the turns a model is shown
"""

import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if __package__ in (None, ""):  # run as a script: import as the data package's module (PEP 366)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "data"


if TYPE_CHECKING:  # data/ stays importable without torch
    from model import ModelConfig

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # Qwen3's and DeepSeek-R1's thought delimiters


# ----------------------------------------------------------------------------- thinking


class Thought(NamedTuple):
    """A completion split at its thought: `thinking` without the tags, `answer` what follows the last
    </think> (the whole text when there is no thought), None when a thought never closes."""

    thinking: str
    answer: str | None


def split_thinking(text: str, open_at_start: bool = False) -> Thought:
    """The thought and the gradable answer of a completion (or of an SFT target).

    open_at_start: the prompt left a <think> open (a chat template that starts the thought itself, as
    DeepSeek-R1's distilled models do), so the completion begins inside it; see data.opens_thought.
    Every grader (math here, code in sandbox.py) reads only Thought.answer.
    """
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        thought, opened = text[:close], text.find(THINK_OPEN)
        return Thought(
            thought[opened + len(THINK_OPEN) :] if 0 <= opened < close else thought, text[close + len(THINK_CLOSE) :]
        )
    opened = text.find(THINK_OPEN)
    if opened >= 0 or open_at_start:
        return Thought(text[opened + len(THINK_OPEN) :] if opened >= 0 else text, None)
    return Thought("", text)


TEMPLATES = {
    "answer": DAPO_PREFIX + "{problem}" + DAPO_SUFFIX,  # DAPO-Math-17k's prompt, word for word
    "boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "plain": "{problem} Answer with the number only.",
    "equation": "{problem}",
    "code": "{problem}\n\nWrite the solution in Python 3, and put the complete program in one ```python code block.",
}
# worked (question, answer) turns placed before the problem, per template; the question is posed by the template
EXAMPLES = {
    "equation": [("What is 2 + 3?", "2 + 3 = 5")],
    "code": [("Read an integer n and print 2 * n + 1.", "```python\nn = int(input())\nprint(2 * n + 1)\n```")],
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


def render_prompt(
    tokenizer, problem: str, template: str = "boxed", system: str | None = None, thinking: bool = False
) -> list[int]:
    """Token ids of the chat prompt for one problem, ending where the assistant's reply begins.

    Goes through tokenizer.apply_chat_template(add_generation_prompt=True, enable_thinking=thinking):
    a template that reads enable_thinking (Qwen3) opens or skips its thought, others ignore it. system=None keeps the
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
        messages += [
            {"role": "user", "content": user_message(question, template)},
            {"role": "assistant", "content": answer},
        ]
    messages.append({"role": "user", "content": message})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    # the rendered text already carries the template's special tokens: adding BOS again would double it
    return tokenizer.encode(text, add_special_tokens=False)


def render_solution(solution: str, answer: str, template: str, thinking: bool = False) -> str:
    """The assistant reply the supervised stage (sft.py) trains on: a worked solution ending in the answer
    format the template asks for, which is where the reward looks for it.

    "answer" ends with a last line "Answer: ..." (DAPO's format), "boxed" with a \\boxed{} (added only when
    the solution has none), "plain" is the answer alone, and "equation" or a custom template keeps the
    solution as it is. A solution that thinks first (<think>...</think>, as OpenMathReasoning's) keeps its
    thought with thinking=True and drops it with thinking=False, as a non-thinking reply has none.
    """
    thought = split_thinking(solution)
    reply = (solution if thought.answer is None else thought.answer).strip()
    if template == "answer":
        reply = f"{reply}\nAnswer: {answer}"
    elif template == "boxed" and "\\boxed" not in reply:
        reply = f"{reply}\nThe final answer is $\\boxed{{{answer}}}$."
    elif template == "plain":
        reply = answer
    if thinking and thought.thinking.strip():
        return f"{THINK_OPEN}\n{thought.thinking.strip()}\n{THINK_CLOSE}\n\n{reply}"
    return reply


def _chat_template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return " ".join(template.values()) if isinstance(template, dict) else template or ""


def takes_thinking(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads the enable_thinking switch (Qwen3's does)."""
    return "enable_thinking" in _chat_template(tokenizer)


def thinking_note(tokenizer, thinking: bool, flag: str = "--thinking") -> str | None:
    """One line when the thinking switch cannot act on this chat template; None when it can (or need not)."""
    if takes_thinking(tokenizer):
        return None
    if thinking:
        return (
            f"{flag} on: the chat template does not read enable_thinking, so the prompt is the same as with "
            f"off; the reward still grades only what follows the last {THINK_CLOSE}"
        )
    if THINK_OPEN in _chat_template(tokenizer):
        return (
            f"{flag} off: the chat template writes {THINK_OPEN} itself and does not read enable_thinking, so "
            "it cannot be switched off"
        )
    return None


def opens_thought(tokenizer, thinking: bool = False) -> bool:
    """Whether the generation prompt leaves a <think> open, so every completion starts inside a thought
    (templates that begin the thought for the model); the reward then scores a completion without
    </think> as unclosed (reward.split_thinking's open_at_start)."""
    if not _chat_template(tokenizer):
        return False
    marker = "@@problem@@"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    generation_prompt = text[text.rfind(marker) + len(marker) :]
    return generation_prompt.rfind(THINK_OPEN) > generation_prompt.rfind(THINK_CLOSE)


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
    parser.add_argument(
        "--template",
        default="boxed",
        help=f"one of {', '.join(TEMPLATES)}, or a string with {{problem}} (default: %(default)s)",
    )
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
