"""Problems for training and evaluation, and the prompts that pose them.

    from data import load_problems, arithmetic_problems, render_prompt
    problems = load_problems("math500")                  # after `python data/prepare.py math500`
    ids = render_prompt(tokenizer, problems[0]["problem"], "boxed")

arithmetic.py generates the offline demo's problems (with worked solutions) and programs.py small programming
problems with tests, prepare.py reads, converts and downloads dataset files, templates.py turns a problem into
chat-formatted token ids, a worked solution into the reply the supervised stage trains on, and names the tokens
that end a reply.
"""

from pathlib import Path

from .arithmetic import DEFAULT_KINDS, KINDS, TWO_DIGIT_KINDS, arithmetic_problems
from .prepare import DATA_DIR, FORMATS, HUB, read_problems, read_rows
from .programs import code_problems
from .templates import (
    TEMPLATES,
    opens_thought,
    render_prompt,
    render_solution,
    stop_ids,
    takes_thinking,
    thinking_note,
    user_message,
)

GENERATED = {  # name -> the problems, made on the fly
    "arithmetic": lambda: arithmetic_problems("train", DEFAULT_KINDS),
    "arithmetic_test": lambda: arithmetic_problems("test", DEFAULT_KINDS),
    "two_digit": lambda: arithmetic_problems("train", TWO_DIGIT_KINDS),
    "two_digit_test": lambda: arithmetic_problems("test", TWO_DIGIT_KINDS),
    "code": lambda: code_problems("train"),
    "code_test": lambda: code_problems("test"),
}


def load_problems(
    name_or_path: str | Path,
    *,
    problem_key: str = "problem",
    answer_key: str = "answer",
    data_dir: str | Path = DATA_DIR,
) -> list[dict]:
    """Problems {"problem", "answer", ...} of a named dataset or of a .jsonl/.json/.parquet file.

    Names: the Hub datasets of prepare.py (files data_dir/NAME.jsonl that it writes), any other
    NAME.jsonl in data_dir (e.g. written by `prepare.py --from FILE --out NAME`), and
    arithmetic / arithmetic_test (the demo's train and held-out splits of the default kinds),
    two_digit / two_digit_test (research/study.py's harder task) and code / code_test (small programming problems with
    tests, programs.py), generated, no file needed.
    Malformed records are a ValueError naming file and line (see prepare.read_problems); keys may be
    dotted to reach nested fields ("reward_model.ground_truth").
    """
    name = str(name_or_path)
    if name.endswith(tuple(FORMATS)):  # a path, not a name
        return read_problems(name, problem_key, answer_key)
    if name in GENERATED:
        return GENERATED[name]()
    path = Path(data_dir) / f"{name}.jsonl"
    if path.is_file():
        return read_problems(path, problem_key, answer_key)
    if name in HUB:
        raise FileNotFoundError(
            f"{path} does not exist: run `python data/prepare.py {name}` to download it, or convert a "
            f"local copy of its files with `python data/prepare.py --from FILE --out {name}`"
        )
    raise ValueError(
        f"unknown dataset {name!r}; known: {', '.join([*HUB, *GENERATED])}, "
        f"any NAME.jsonl in {data_dir}, or a path ending in .jsonl, .json or .parquet"
    )


def problem_location(name_or_path: str | Path, index: int, *, data_dir: str | Path = DATA_DIR) -> str:
    """Where problem `index` of load_problems(name_or_path) comes from: "FILE:LINE" (or the item or row of a
    .json or .parquet file), or "NAME, problem N" for a generated set. Read again only for an error message."""
    name = str(name_or_path)
    path = Path(name) if name.endswith(tuple(FORMATS)) else Path(data_dir) / f"{name}.jsonl"
    if name not in GENERATED and path.is_file():
        for position, (where, _) in enumerate(read_rows(path)):
            if position == index:
                return where
    return f"{name}, problem {index + 1}"


__all__ = [
    "DEFAULT_KINDS",
    "KINDS",
    "TEMPLATES",
    "arithmetic_problems",
    "code_problems",
    "load_problems",
    "opens_thought",
    "problem_location",
    "read_problems",
    "render_prompt",
    "render_solution",
    "stop_ids",
    "takes_thinking",
    "thinking_note",
    "user_message",
]
