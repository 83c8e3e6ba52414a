"""Dataset files: read and check them, convert local copies, download public sets from the Hub.

Every prepared dataset is a JSON-lines file data/NAME.jsonl, one {"problem", "answer", "source"}
object a line, with the problem bare (no instruction: templates.py adds that) and the answer a
string. Reading is strict: a line that is not JSON, lacks a field, or has an empty problem or
answer is a ValueError naming the file and line, so a dataset is never silently shortened.

    python data/prepare.py math500 aime24            # download from the Hub (needs network)
    python data/prepare.py all
    python data/prepare.py --from my.jsonl --problem-key question --answer-key solution --out mine

Hub sources (repo ids, file layouts and columns checked against the repos' file listings, dataset
cards and published code that loads them):
    dapo         BytedTsinghua-SIA/DAPO-Math-17k  data/*.parquet        prompt[0].content, reward_model.ground_truth
    math500      HuggingFaceH4/MATH-500           test.jsonl            problem, answer (LaTeX, kept as is)
    gsm8k        openai/gsm8k                     main/test-*.parquet   question, answer (the number after "####")
    gsm8k_train  openai/gsm8k                     main/train-*.parquet  question, answer
    aime24       HuggingFaceH4/aime_2024          data/*.parquet        problem, answer (AIME 2024 I and II)
    aime25       opencompass/AIME2025             aime2025-*.jsonl      question, answer (AIME 2025 I and II)
    amc23        math-ai/amc23                    test-*.parquet        question, answer (AMC 2023: the 40 problems of
                                                                        Qwen2.5-Math's evaluation)
Most hub copies are parquet files, read with pyarrow; the conversion functions below take plain
rows, so they serve local files too. huggingface_hub and pyarrow are imported only where needed,
so converting a local file runs on the standard library alone.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator

DATA_DIR = Path(__file__).resolve().parent
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


# ---------------------------------------------------------------- reading and writing files


def _answer_text(value) -> str | None:
    """Answers are compared as text; JSON numbers are accepted and written the way they read."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)):
        return str(value)
    return value.strip() if isinstance(value, str) else None


def _records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, parsed object) for each record: JSON lines, or a .json file holding one JSON list."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        for index, item in enumerate(items):
            yield f"{path}: item {index}", item
        return
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 and friends, which are not line ends here
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: invalid JSON: {e.msg}") from None


def read_problems(path: str | Path, problem_key: str = "problem", answer_key: str = "answer") -> list[dict]:
    """Every record of a .jsonl/.json file as {"problem", "answer", ...the record's other fields}.

    Raises ValueError naming file and line for a record that is not an object, lacks either key,
    or has an empty problem or answer, and for a file with no records at all.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such dataset file: {path}")
    problems = []
    for where, record in _records(path):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for key in (problem_key, answer_key):
            if key not in record:
                raise ValueError(f"{where}: missing field {key!r} (fields: {', '.join(record) or 'none'})")
        problem, answer = record[problem_key], _answer_text(record[answer_key])
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{where}: empty or non-text problem in field {problem_key!r}")
        if not answer:
            raise ValueError(f"{where}: empty or non-text answer in field {answer_key!r}")
        extra = {k: v for k, v in record.items() if k not in (problem_key, answer_key)}
        problems.append({"problem": problem.strip(), "answer": answer, **extra})
    if not problems:
        raise ValueError(f"{path}: no problems in file")
    return problems


def write_jsonl(problems: Iterable[dict], path: str | Path) -> int:
    """Write one JSON object a line, atomically (a crash never leaves half a dataset); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for problem in problems:
                f.write(json.dumps(problem, ensure_ascii=False) + "\n")
                count += 1
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return count


def dedupe(problems: Iterable[dict]) -> Iterator[dict]:
    """Drop repeats of an earlier (problem, answer) pair, keeping first occurrences in order."""
    seen = set()
    for problem in problems:
        key = (problem["problem"], problem["answer"])
        if key not in seen:
            seen.add(key)
            yield problem


# ---------------------------------------------------------------- Hub rows -> problems (pure)


def strip_dapo_prompt(prompt: str) -> str:
    """The bare problem inside DAPO's "Answer:" instruction wrapper."""
    if not (prompt.startswith(DAPO_PREFIX) and prompt.endswith(DAPO_SUFFIX)):
        raise ValueError(f"DAPO prompt without the expected instruction wrapper: {prompt[:80]!r}...")
    return prompt[len(DAPO_PREFIX) : -len(DAPO_SUFFIX)].strip()


def convert_dapo(rows: Iterable[dict], source: str) -> Iterator[dict]:
    """DAPO-Math-17k rows (chat-format prompt, reward_model.ground_truth) -> distinct bare problems.

    The Hub file lists its 17,917 rows 100 times each (1.79M rows), and 650 of those rows repeat
    another's problem and answer (up to surrounding whitespace) under a new index: 17,267 remain.
    """
    problems = (
        {
            "problem": strip_dapo_prompt(row["prompt"][0]["content"]),
            "answer": _answer_text(row["reward_model"]["ground_truth"]),
            "source": source,
        }
        for row in rows
    )
    return dedupe(problems)


def gsm8k_answer(solution: str) -> str:
    """GSM8K's final answer: the number after '####' at the end of the solution, commas removed."""
    marker = solution.rfind("####")
    if marker < 0:
        raise ValueError(f"GSM8K solution without '####': {solution[-80:]!r}")
    return solution[marker + 4 :].strip().replace(",", "")


def convert_gsm8k(rows: Iterable[dict], source: str) -> Iterator[dict]:
    for row in rows:
        yield {"problem": row["question"].strip(), "answer": gsm8k_answer(row["answer"]), "source": source}


def convert_math500(rows: Iterable[dict], source: str) -> Iterator[dict]:
    """MATH-500 answers are LaTeX (\\frac{14}{3}, \\text{Evelyn}) and are kept verbatim."""
    for row in rows:
        yield {"problem": row["problem"].strip(), "answer": row["answer"].strip(), "source": source}


def integer_answer(answer) -> str:
    """Competition answers written as '025' or 27.0 become '25' and '27'; anything else is kept."""
    text = _answer_text(answer)
    match = re.fullmatch(r"(-?)0*(\d+)(?:\.0*)?", text or "")
    return match[1] + match[2] if match else text


def convert_competition(rows: Iterable[dict], source: str) -> Iterator[dict]:
    """AIME and AMC rows: the problem under "problem" or "question" (mirrors differ), an integer answer."""
    for row in rows:
        problem = row["problem"] if "problem" in row else row["question"]
        yield {"problem": problem.strip(), "answer": integer_answer(row["answer"]), "source": source}


# ---------------------------------------------------------------- the Hub (thin layer)

# name -> (repo id, file patterns, rows -> problems)
HUB = {
    "dapo": ("BytedTsinghua-SIA/DAPO-Math-17k", "data/*.parquet", convert_dapo),
    "math500": ("HuggingFaceH4/MATH-500", "test.jsonl", convert_math500),
    "gsm8k": ("openai/gsm8k", "main/test-*.parquet", convert_gsm8k),
    "gsm8k_train": ("openai/gsm8k", "main/train-*.parquet", convert_gsm8k),
    "aime24": ("HuggingFaceH4/aime_2024", "data/*.parquet", convert_competition),
    "aime25": ("opencompass/AIME2025", "aime2025-*.jsonl", convert_competition),
    "amc23": ("math-ai/amc23", "test-*.parquet", convert_competition),
}


def _file_rows(path: Path) -> Iterator[dict]:
    """Raw rows of a downloaded file, streamed: the DAPO parquet file alone holds 1.79M rows."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=10_000):
            yield from batch.to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            yield from (json.loads(line) for line in f if line.strip())


def download(name: str, data_dir: str | Path = DATA_DIR) -> Path:
    """Fetch one Hub dataset, convert it and write data_dir/NAME.jsonl; returns that path."""
    if name not in HUB:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(HUB)}")
    repo, pattern, convert = HUB[name]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, repo_type="dataset", allow_patterns=pattern))
    except LocalEntryNotFoundError as e:  # what both no network and HF_HUB_OFFLINE=1 raise
        raise ConnectionError(
            f"cannot download {repo} (no network, or HF_HUB_OFFLINE is set, and no cached copy).\n"
            f"With a local copy of the data, convert it instead:\n"
            f"  python data/prepare.py --from FILE --problem-key KEY --answer-key KEY --out {name}"
        ) from e
    files = sorted(folder.glob(pattern))
    if not files:
        raise FileNotFoundError(f"{repo} has no file matching {pattern!r}; its layout may have changed")
    rows = (row for path in files for row in _file_rows(path))
    try:
        return _write_checked(convert(rows, repo), Path(data_dir) / f"{name}.jsonl")
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{repo}: unexpected row layout ({e!r}); the dataset may have changed") from e


def convert_file(
    path: str | Path, out: str, problem_key: str, answer_key: str, remove_duplicates: bool, data_dir: str | Path
) -> Path:
    """A local .jsonl/.json file -> data_dir/OUT.jsonl in the prepared format."""
    if Path(out).name != out or Path(out).suffix in (".json", ".jsonl"):
        raise ValueError(f"--out takes a dataset name such as 'math500' (written as NAME.jsonl), got {out!r}")
    problems = read_problems(path, problem_key, answer_key)
    for problem in problems:
        problem.setdefault("source", str(path))
    return _write_checked(dedupe(problems) if remove_duplicates else problems, Path(data_dir) / f"{out}.jsonl")


def _write_checked(problems: Iterable[dict], path: Path) -> Path:
    count = write_jsonl(problems, path)
    try:
        read_problems(path)  # what is written must load: fail here, not in the middle of a training run
    except ValueError as e:
        path.unlink()
        raise ValueError(f"converted data failed its check, so {path.name} was not kept: {e}") from None
    print(f"wrote {count} problems to {path}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"Hub datasets to download: {', '.join(HUB)}, or all")
    parser.add_argument("--from", dest="source", metavar="FILE", help="convert this local .jsonl/.json file")
    parser.add_argument("--problem-key", default="problem", help="field holding the problem (with --from)")
    parser.add_argument("--answer-key", default="answer", help="field holding the answer (with --from)")
    parser.add_argument("--out", help="name of the converted dataset: writes DATA_DIR/OUT.jsonl (with --from)")
    parser.add_argument("--dedupe", action="store_true", help="drop repeated (problem, answer) pairs (with --from)")
    parser.add_argument("--data-dir", default=str(DATA_DIR), help="where prepared datasets are written")
    args = parser.parse_args(argv)
    if bool(args.source) == bool(args.names):
        parser.error("give either dataset names to download or --from FILE --out NAME")
    if args.source and not args.out:
        parser.error("--from needs --out NAME")
    names = list(HUB) if args.names == ["all"] else args.names
    unknown = [name for name in names if name not in HUB]
    if unknown:
        parser.error(f"unknown datasets {unknown}; known: {', '.join(HUB)}, or all")
    try:
        if args.source:
            convert_file(args.source, args.out, args.problem_key, args.answer_key, args.dedupe, args.data_dir)
        for name in names:
            download(name, args.data_dir)
    except (ValueError, OSError, ImportError) as e:
        sys.exit(f"prepare.py: {e}")


if __name__ == "__main__":
    main()
