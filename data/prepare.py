"""Dataset files: read and check them, convert local copies, download public sets from the Hub.

Every prepared dataset is a JSON-lines file data/NAME.jsonl, one {"problem", "answer", "source"}
object a line, with the problem bare (no instruction: templates.py adds that) and the answer a
string. Sets for the supervised stage (sft.py) add a "solution": a worked solution whose final answer
is the answer (templates.render_solution writes its last line in the format a template asks for).
A code problem has tests instead of an answer (its format and its Hub layouts: code_layouts.py);
grading/sandbox.py grades it. Reading is strict: a line that is not JSON, lacks
a field, has an empty problem or answer, or malformed tests is a ValueError naming the file and
line, so a dataset is never silently shortened.

    python data/prepare.py math500 aime24            # download from the Hub (needs network)
    python data/prepare.py all
    python data/prepare.py --from test-00000-of-00001.parquet --out gsm8k     # a local copy of a Hub dataset
    python data/prepare.py --from my.jsonl --problem-key question --answer-key solution --out mine
    python data/prepare.py --from dapo.parquet --problem-key prompt.0.content \\
        --answer-key reward_model.ground_truth --out mine

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
    amc83        AI-MO/aimo-validation-amc        data/train-*.parquet  problem, answer (AMC 12 2022 and 2023 with
                                                                        integer answers, 83: the AMC set of the
                                                                        reasoning-RL papers, ATR-GRPO's "AMC23")
    brumo25      MathArena/brumo_2025             data/train-*.parquet  problem_idx, problem, answer (BRUMO 2025, 30)
    smt25        MathArena/smt_2025               data/train-*.parquet  problem_idx, problem, answer (SMT 2025)
  with solutions, for sft.py:
    openmath     nvidia/OpenMathReasoning         data/cot-00000-of-*   problem, generated_solution, expected_answer:
                                                  .parquet              the first shard of the cot split, kept where the
                                                                        solution's final answer grades equal to the
                                                                        expected one (other shards: --from FILE)
    gsm8k_sft    openai/gsm8k                     main/train-*.parquet  question, answer: the worked solution, its
                                                                        <<calculator>> notes and "#### n" line removed
    math_sft     MaziyarPanahi/MATH-lighteval     data/train-*.parquet  problem, solution (MATH's 7,500 training
                                                                        problems, a copy of lighteval/MATH); the answer
                                                                        is the solution's last \\boxed{}
Code sources (stdio unless noted; a statement that states a float tolerance keeps it):
    apps           codeparrot/apps                     test.jsonl            question, starter_code, input_output (JSON:
                                                                             inputs, outputs, fn_name for call style)
    taco           BAAI/TACO                           ALL/test-*.parquet    the same fields as APPS
    taco_train     BAAI/TACO                           ALL/train-*.parquet
    code_contests  deepmind/code_contests              data/test-*.parquet   description; public, private and generated
                                                                             tests {input: [...], output: [...]}
    codeforces     open-r1/codeforces                  data/test-*.parquet   title, description, input/output_format,
                                                                             examples, note, official_tests
    livecodebench  livecodebench/code_generation_lite  test*.jsonl           question_content, starter_code, public and
                                                                             private test cases, metadata.func_name
Problems these tests cannot grade are skipped and counted per dataset: interactive ones, ones reading or
writing named files, ones needing a checker (several right answers), ones without tests. Codeforces and
CodeContests problems whose statement accepts the answer in any letter case carry "case_sensitive": false,
as their judges compare so (code_layouts.py). The code training set (taco_train) is decontaminated: a
problem whose statement repeats one of an evaluated code set's (CODE_BENCHMARKS), exactly or nearly
(decontaminate), is removed, and the removals are printed by kind and by set.
A local copy of one of these, in .parquet, .jsonl or .json (a list, an object holding one list such as
{"data": [...]}, or JSON lines as `datasets` writes them), converts by its layout: `--out NAME` with a
Hub name, or `--layout` (dapo, gsm8k, math500, aime, amc, matharena, openmath, gsm8k_solution,
math_solution, apps, taco, code_contests, codeforces, livecodebench) with any name; a file already in
the prepared format (problem and answer fields) that does not fit that layout is read as it is. Any other file converts by field names, dotted for nested
fields; read by field names, a problem in DAPO's instruction wrapper is unwrapped and a GSM8K worked
solution ending "#### 18" gives the answer "18", so a Hub copy read by keys is right too.
pyarrow and huggingface_hub are imported only where needed, so JSON files need the standard library alone.
"""

import argparse
import json
import os
import pickle
import re
import sys
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator

if __package__ in (None, ""):  # run as `python data/prepare.py`: import as the data package's module (PEP 366);
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the answer checker, reward.py, is one up
    __package__ = "data"

from .code_layouts import CODE_LAYOUTS, STDIO_NOTE, Skip, check_code_problem  # noqa: E402
from .templates import DAPO_PREFIX, DAPO_SUFFIX  # noqa: E402

DATA_DIR = Path(__file__).resolve().parent
FORMATS = {".jsonl": "JSON lines", ".json": "JSON (one list, or JSON lines)", ".parquet": "parquet"}
GSM8K_SOLUTION = re.compile(r"\n####\s*[^\n]+$")  # a worked solution whose last line is "#### 18"
GSM8K_CALCULATOR = re.compile(r"<<[^<>]*>>")  # the annotations of GSM8K's calculator: "48/2 = <<48/2=24>>24"
GRADE_BATCH = 512  # OpenMathReasoning rows graded per call of the answer checker


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


def read_rows(path: str | Path) -> Iterator[tuple[str, object]]:
    """(where, record) for every record of a .jsonl, .json or .parquet file, streamed.

    `where` names the file and line ("f.jsonl:3"), list item ("f.json: item 2") or row ("f.parquet: row 7").
    A file that cannot be read in its format is a ValueError naming the file and the format expected.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such dataset file: {path}")
    if path.suffix not in FORMATS:
        raise ValueError(f"{path}: unknown file type {path.suffix!r}; expected .jsonl, .json or .parquet")
    if path.suffix == ".parquet":
        yield from _parquet_rows(path)
        return
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is not data
    except UnicodeDecodeError as e:
        hint = "; it is a parquet file: name it .parquet" if path.read_bytes()[:4] == b"PAR1" else ""
        raise ValueError(
            f"{path}: cannot read as {FORMATS[path.suffix]}: not UTF-8 text (byte {e.start}){hint}"
        ) from None
    if path.suffix == ".json" and text.lstrip().startswith(("[", "{")):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("["):
                raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
            items = None  # not one object: JSON lines, read below
        lists = (
            [
                key
                for key, value in items.items()
                if isinstance(value, list) and all(isinstance(item, dict) for item in value)
            ]
            if isinstance(items, dict)
            else []
        )
        if len(lists) > 1:
            raise ValueError(
                f"{path}: one JSON object holding {len(lists)} lists ({', '.join(lists)}); expected a "
                "list of records, JSON lines, or an object whose one list holds the records"
            )
        if lists:  # {"data": [...]}: the records are the one list the object holds
            yield from ((f"{path}: {lists[0]} item {index}", item) for index, item in enumerate(items[lists[0]]))
            return
        if isinstance(items, list):
            yield from ((f"{path}: item {index}", item) for index, item in enumerate(items))
            return
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 and friends, which are not line ends here
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: invalid JSON: {e.msg}") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Rows in batches: the DAPO parquet file alone holds 1.79M rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=10_000)
        index = 0
        for batch in batches:
            for row in batch.to_pylist():
                yield f"{path}: row {index}", row
                index += 1
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot read as parquet: {e}") from None


def field(record: dict, key: str):
    """record[key], where a dotted key reaches into nested objects and lists: "prompt.0.content".

    A key that is itself a field name (dots included) wins. Raises KeyError(key) when the path is absent.
    """
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise KeyError(key)
    return value


def bare(problem: str, answer: str) -> tuple[str, str]:
    """The problem without DAPO's instruction wrapper, and the final answer of a GSM8K worked solution.

    Hub copies read by field names carry both: the wrapper would be added twice by the "answer"
    template, and a whole solution as the reference answer can never be matched by a completion.
    """
    if problem.startswith(DAPO_PREFIX) and problem.endswith(DAPO_SUFFIX):
        problem = strip_dapo_prompt(problem)
    if GSM8K_SOLUTION.search(answer):
        answer = gsm8k_answer(answer)
    return problem, answer


def read_problems(path: str | Path, problem_key: str = "problem", answer_key: str = "answer") -> list[dict]:
    """Every record of a .jsonl/.json/.parquet file as {"problem", "answer", ...the record's other fields}.

    Keys may be dotted ("reward_model.ground_truth", see field()); problem and answer go through bare().
    A record whose "task" is "code" has tests instead of an answer (check_code_problem) and is kept as is.
    Raises ValueError naming file and line for a record that is not an object, lacks either key,
    or has an empty problem or answer, and for a file with no records at all.
    """
    used = {problem_key, answer_key, problem_key.split(".")[0], answer_key.split(".")[0]}  # not kept as extras
    problems = []
    for where, record in read_rows(path):
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if record.get("task") == "code":  # graded by its tests, not an answer
            problem = record.get("problem")
            if not isinstance(problem, str) or not problem.strip():
                raise ValueError(f"{where}: empty or non-text problem in field 'problem'")
            check_code_problem(record, where)
            problems.append(record)
            continue
        try:
            problem, answer = field(record, problem_key), _answer_text(field(record, answer_key))
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r} (fields: {', '.join(record) or 'none'})") from None
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{where}: empty or non-text problem in field {problem_key!r}")
        if not answer:
            raise ValueError(f"{where}: empty or non-text answer in field {answer_key!r}")
        problem, answer = bare(problem.strip(), answer)
        extra = {k: v for k, v in record.items() if k not in used}
        problems.append({"problem": problem, "answer": answer, **extra})
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
                # default=str: parquet columns may hold dates or bytes, which JSON has no type for
                f.write(json.dumps(problem, ensure_ascii=False, default=str) + "\n")
                count += 1
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return count


def dedupe(problems: Iterable[dict]) -> Iterator[dict]:
    """Drop repeats of an earlier (problem, answer or tests), keeping first occurrences in order."""
    seen = set()
    for problem in problems:
        key = (problem["problem"], problem.get("answer"), json.dumps(problem.get("tests")))
        if key not in seen:
            seen.add(key)
            yield problem


# ---------------------------------------------------------------- Hub layouts: one row -> one problem (pure)


def strip_dapo_prompt(prompt: str) -> str:
    """The bare problem inside DAPO's "Answer:" instruction wrapper."""
    if not (prompt.startswith(DAPO_PREFIX) and prompt.endswith(DAPO_SUFFIX)):
        raise ValueError(f"DAPO prompt without the expected instruction wrapper: {prompt[:80]!r}...")
    return prompt[len(DAPO_PREFIX) : -len(DAPO_SUFFIX)].strip()


def gsm8k_answer(solution: str) -> str:
    """GSM8K's final answer: the number after '####' at the end of the solution, commas removed."""
    marker = solution.rfind("####")
    if marker < 0:
        raise ValueError(f"GSM8K solution without '####': {solution[-80:]!r}")
    return solution[marker + 4 :].strip().replace(",", "")


def integer_answer(answer) -> str:
    """Competition answers written as '025' or 27.0 become '25' and '27'; anything else is kept."""
    text = _answer_text(answer)
    match = re.fullmatch(r"(-?)0*(\d+)(?:\.0*)?", text or "")
    return match[1] + match[2] if match else text


def dapo_row(row: dict) -> dict:
    """DAPO-Math-17k: a chat-format prompt in DAPO's wrapper, the answer in reward_model.ground_truth."""
    return {
        "problem": strip_dapo_prompt(row["prompt"][0]["content"]),
        "answer": _answer_text(row["reward_model"]["ground_truth"]),
    }


def gsm8k_row(row: dict) -> dict:
    """GSM8K: "question", and "answer" holding the worked solution that ends "#### 18"."""
    return {"problem": row["question"].strip(), "answer": gsm8k_answer(row["answer"])}


def math500_row(row: dict) -> dict:
    """MATH-500 answers are LaTeX (\\frac{14}{3}, \\text{Evelyn}) and are kept verbatim."""
    return {"problem": row["problem"].strip(), "answer": row["answer"].strip()}


def competition_row(row: dict) -> dict:
    """AIME and AMC: the problem under "problem", "question" or "Problem" (mirrors differ), an integer answer."""
    problem_key = next((key for key in ("problem", "question", "Problem") if key in row), "problem")
    answer_key = "Answer" if "Answer" in row else "answer"
    return {"problem": row[problem_key].strip(), "answer": integer_answer(row[answer_key])}


def matharena_row(row: dict) -> dict:
    """MathArena's competitions (BRUMO, SMT): problem_idx, problem, and a LaTeX answer, kept as is."""
    return {"problem": row["problem"].strip(), "answer": integer_answer(row["answer"]), "id": row["problem_idx"]}


def openmath_row(row: dict) -> dict:
    """OpenMathReasoning: a problem, a generated solution (a thought, then a summary ending in \\boxed{}) and
    the expected answer; whether the solution reaches that answer is checked by convert_rows."""
    return {
        "problem": row["problem"].strip(),
        "answer": _answer_text(row["expected_answer"]) or "",
        "solution": row["generated_solution"].strip(),
    }


def gsm8k_solution_row(row: dict) -> dict:
    """GSM8K's worked solution without its calculator notes and its "#### n" line, which a template rewrites."""
    solution = GSM8K_CALCULATOR.sub("", row["answer"])
    return {
        "problem": row["question"].strip(),
        "answer": gsm8k_answer(row["answer"]),
        "solution": GSM8K_SOLUTION.sub("", solution).strip(),
    }


def math_solution_row(row: dict) -> dict:
    """MATH: the solution ends in \\boxed{answer}, which is the answer."""
    import reward

    return {
        "problem": row["problem"].strip(),
        "answer": reward.extract_answer(row["solution"]) or "",
        "solution": row["solution"].strip(),
    }


class LayoutError(ValueError):
    """A row that does not fit the layout it was read as."""


LAYOUTS = {
    "dapo": dapo_row,
    "gsm8k": gsm8k_row,
    "math500": math500_row,
    "aime": competition_row,
    "amc": competition_row,
    "matharena": matharena_row,
    "openmath": openmath_row,
    "gsm8k_solution": gsm8k_solution_row,
    "math_solution": math_solution_row,
}


def matching_solutions(problems: Iterable[dict]) -> Iterator[dict]:
    """The problems whose solution's final answer (after its thought) grades equal to the expected answer.

    OpenMathReasoning's solutions are sampled, so some reach another answer, and some problems have no
    expected answer at all; a supervised stage must not learn those. Prints how many were kept.
    """
    import reward

    counts = {"kept": 0, "total": 0}
    batch: list[dict] = []

    def graded() -> Iterator[dict]:
        with_answers = [p for p in batch if p["answer"]]
        scores = reward.reward([p["solution"] for p in with_answers], [p["answer"] for p in with_answers])
        for problem, score in zip(with_answers, scores):
            if score == 1.0:
                counts["kept"] += 1
                yield problem
        batch.clear()

    for problem in problems:
        counts["total"] += 1
        batch.append(problem)
        if len(batch) == GRADE_BATCH:
            yield from graded()
    yield from graded()
    print(f"kept {counts['kept']} of {counts['total']} solutions: those whose final answer matches the expected one")


def convert_rows(rows: Iterable[tuple[str, dict]], layout: str, source: str) -> Iterator[dict]:
    """(where, row) pairs of a Hub copy in one of LAYOUTS -> {"problem", "answer", "source"}, or in one of
    CODE_LAYOUTS -> code problems {"problem", "task": "code", "style", "tests", ...}; a code row these tests
    cannot grade is skipped, and the skips are counted by reason.

    A row that does not fit the layout is a ValueError naming where it is. DAPO's repeats are dropped:
    the Hub file lists its 17,917 rows 100 times each (1.79M rows), and 650 of those rows repeat
    another's problem and answer (up to surrounding whitespace) under a new index: 17,267 remain.
    """
    if layout not in LAYOUTS and layout not in CODE_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join([*LAYOUTS, *CODE_LAYOUTS])}")
    code = layout in CODE_LAYOUTS
    to_problem = CODE_LAYOUTS[layout] if code else LAYOUTS[layout]

    def problems() -> Iterator[dict]:
        skipped: dict[str, int] = {}
        for index, (where, row) in enumerate(rows):
            try:
                problem = to_problem(row, index) if code else to_problem(row)
            except Skip as reason:
                skipped[str(reason)] = skipped.get(str(reason), 0) + 1
                continue
            except (KeyError, IndexError, TypeError, AttributeError) as e:
                fields = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                raise LayoutError(
                    f"{where}: not a row of the {layout} layout ({type(e).__name__}: {e}; fields: {fields})"
                ) from None
            except (ValueError, zlib.error, pickle.UnpicklingError) as e:  # json's errors are ValueErrors
                raise ValueError(f"{where}: {e}") from None
            if code:
                check_code_problem(problem, where)
            elif not problem["problem"] or (not problem["answer"] and layout != "openmath"):
                raise ValueError(f"{where}: empty problem or answer in the {layout} layout")
            yield {**problem, "source": source}
        if skipped:
            print(
                f"{source}: skipped {sum(skipped.values())} problems these tests cannot grade: "
                + ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
            )

    if layout == "openmath":  # its rows without an expected answer are dropped with the unmatched ones
        return matching_solutions(problems())
    return dedupe(problems()) if layout == "dapo" else problems()


# ---------------------------------------------------------------- decontamination of the code training set

CODE_BENCHMARKS = ("taco", "apps", "code_contests", "codeforces", "livecodebench")  # the evaluated code sets
DECONTAMINATE = {"taco_train": CODE_BENCHMARKS}  # training set -> the sets its problems must not repeat
NGRAM = 10  # words per shingle of a near-duplicate check
NEAR = 0.5  # near-duplicate: this share of the shorter statement's shingles found in the other's
COMMON = 20  # a shingle in more benchmark statements than this is boilerplate ("the first line contains ...")


def statement_words(text: str) -> tuple[str, ...]:
    """A code statement as lowercase word tokens, without the note a layout appends (what the program must
    do), so that a stdio and a call-style copy of one problem compare by their statements alone."""
    for note in ("\n\n" + STDIO_NOTE, "\n\nComplete this code;"):
        text = text.split(note)[0]
    return tuple(re.findall(r"\w+", text.lower()))


def shingles(words: tuple[str, ...]) -> set[int]:
    """The hashed NGRAM-word windows of a statement (none below NGRAM words: such a one matches only exactly)."""
    return {hash(words[i : i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


def benchmark_index(statements: Iterable[tuple[str, str]]) -> dict:
    """(benchmark, statement) pairs indexed for duplicate_of: exact word sequences, and shingle -> statements
    holding it (boilerplate shingles, in more than COMMON statements, left out)."""
    exact, sizes, postings = {}, [], {}
    for name, text in statements:
        words = statement_words(text)
        exact.setdefault(words, name)
        grams = shingles(words)
        for gram in grams:
            postings.setdefault(gram, []).append(len(sizes))
        sizes.append((name, len(grams)))
    postings = {gram: ids for gram, ids in postings.items() if len(ids) <= COMMON}
    return {"exact": exact, "sizes": sizes, "postings": postings}


def duplicate_of(text: str, index: dict) -> tuple[str, str] | None:
    """("exact" or "near", benchmark) when a statement repeats one of the index's, else None. Exact: the same
    words (case, punctuation and spacing aside). Near: NEAR of the shorter statement's shingles shared."""
    words = statement_words(text)
    if words in index["exact"]:
        return "exact", index["exact"][words]
    grams = shingles(words)
    shared = Counter(i for gram in grams for i in index["postings"].get(gram, ()))
    for i, count in shared.most_common(1):
        name, size = index["sizes"][i]
        if count >= NEAR * min(len(grams), size):
            return "near", name
    return None


def read_statements(names: Iterable[str], data_dir: str | Path) -> Iterator[tuple[str, str]]:
    """(benchmark, statement) of every problem of the prepared benchmark files, streamed (their tests unread)."""
    for name in names:
        for _, record in read_rows(Path(data_dir) / f"{name}.jsonl"):
            yield name, record["problem"]


def decontaminate(problems: Iterable[dict], index: dict, name: str) -> Iterator[dict]:
    """The problems whose statement repeats no benchmark's (duplicate_of); prints how many were removed,
    exact and near, and from which benchmarks."""
    removed: Counter = Counter()
    total = 0
    for problem in problems:
        total += 1
        found = duplicate_of(problem["problem"], index)
        if found is None:
            yield problem
        else:
            removed.update([found[0], found[1]])
    kinds = {"exact", "near"}
    by_set = ", ".join(f"{removed[b]} {b}" for b in sorted(set(removed) - kinds))
    print(
        f"{name}: removed {removed['exact'] + removed['near']} of {total} problems that repeat an evaluated code "
        f"set's statement ({removed['exact']} exact, {removed['near']} near-duplicate"
        + (f"; {by_set}" if by_set else "")
        + ")"
    )


def decontaminated(problems: Iterable[dict], name: str, data_dir: str | Path) -> Iterable[dict]:
    """problems as they are, or, for a training set of DECONTAMINATE, without the benchmarks' problems (their
    prepared files must be in data_dir: a ValueError names those that are not, before any problem is read)."""
    if name not in DECONTAMINATE:
        return problems
    missing = [b for b in DECONTAMINATE[name] if not (Path(data_dir) / f"{b}.jsonl").is_file()]
    if missing:
        raise ValueError(
            f"{name} is decontaminated against the evaluated code sets; prepare {', '.join(missing)} first "
            f"(python data/prepare.py {' '.join(missing)})"
        )
    return decontaminate(problems, benchmark_index(read_statements(DECONTAMINATE[name], data_dir)), name)


# ---------------------------------------------------------------- the Hub (thin layer)

# name -> (repo id, file patterns, layout)
HUB = {
    "dapo": ("BytedTsinghua-SIA/DAPO-Math-17k", "data/*.parquet", "dapo"),
    "math500": ("HuggingFaceH4/MATH-500", "test.jsonl", "math500"),
    "gsm8k": ("openai/gsm8k", "main/test-*.parquet", "gsm8k"),
    "gsm8k_train": ("openai/gsm8k", "main/train-*.parquet", "gsm8k"),
    "aime24": ("HuggingFaceH4/aime_2024", "data/*.parquet", "aime"),
    "aime25": ("opencompass/AIME2025", "aime2025-*.jsonl", "aime"),
    "amc23": ("math-ai/amc23", "test-*.parquet", "amc"),
    "amc83": ("AI-MO/aimo-validation-amc", "data/train-*.parquet", "amc"),
    "brumo25": ("MathArena/brumo_2025", "data/train-*.parquet", "matharena"),
    "smt25": ("MathArena/smt_2025", "data/train-*.parquet", "matharena"),
    "openmath": ("nvidia/OpenMathReasoning", "data/cot-00000-of-*.parquet", "openmath"),
    "gsm8k_sft": ("openai/gsm8k", "main/train-*.parquet", "gsm8k_solution"),
    "math_sft": ("MaziyarPanahi/MATH-lighteval", "data/train-*.parquet", "math_solution"),
    "apps": ("codeparrot/apps", "test.jsonl", "apps"),
    "taco": ("BAAI/TACO", "ALL/test-*.parquet", "taco"),
    "code_contests": ("deepmind/code_contests", "data/test-*.parquet", "code_contests"),
    "codeforces": ("open-r1/codeforces", "data/test-*.parquet", "codeforces"),
    "livecodebench": ("livecodebench/code_generation_lite", "test*.jsonl", "livecodebench"),
    "taco_train": ("BAAI/TACO", "ALL/train-*.parquet", "taco"),  # after the sets it is decontaminated against
}


def download(name: str, data_dir: str | Path = DATA_DIR) -> Path:
    """Fetch one Hub dataset, convert it and write data_dir/NAME.jsonl; returns that path. A training set of
    DECONTAMINATE fetches the benchmarks it is checked against first, where they are not prepared yet."""
    if name not in HUB:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(HUB)}")
    for benchmark in DECONTAMINATE.get(name, ()):
        if not (Path(data_dir) / f"{benchmark}.jsonl").is_file():
            download(benchmark, data_dir)
    repo, pattern, layout = HUB[name]
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo, repo_type="dataset", allow_patterns=pattern))
    except LocalEntryNotFoundError as e:  # what both no network and HF_HUB_OFFLINE=1 raise
        raise ConnectionError(
            f"cannot download {repo} (no network, or HF_HUB_OFFLINE is set, and no cached copy).\n"
            f"With a local copy of its files (parquet, jsonl or json), convert it instead:\n"
            f"  python data/prepare.py --from FILE --out {name}"
        ) from e
    files = sorted(folder.glob(pattern))
    if not files:
        raise FileNotFoundError(f"{repo} has no file matching {pattern!r}; its layout may have changed")
    rows = (row for path in files for row in read_rows(path))
    problems = decontaminated(convert_rows(rows, layout, repo), name, data_dir)
    return _write_checked(problems, Path(data_dir) / f"{name}.jsonl")


def convert_file(
    path: str | Path,
    out: str,
    *,
    layout: str | None = None,
    problem_key: str = "problem",
    answer_key: str = "answer",
    remove_duplicates: bool = False,
    data_dir: str | Path = DATA_DIR,
) -> Path:
    """A local .jsonl/.json/.parquet file -> data_dir/OUT.jsonl in the prepared format.

    With a layout (a key of LAYOUTS) the file is a copy of that Hub dataset; without, the problem and
    answer are read from the named (dotted) fields by read_problems. An OUT of DECONTAMINATE is
    decontaminated against the benchmarks prepared in data_dir.
    """
    if Path(out).name != out or Path(out).suffix in (".json", ".jsonl"):
        raise ValueError(f"--out takes a dataset name such as 'math500' (written as NAME.jsonl), got {out!r}")
    if layout is not None:
        try:
            problems = list(decontaminated(convert_rows(read_rows(path), layout, str(path)), out, data_dir))
        except LayoutError as error:
            raise LayoutError(f"{error}; for a file in another layout give --problem-key and --answer-key") from None
    else:
        problems = read_problems(path, problem_key, answer_key)
        for problem in problems:
            problem.setdefault("source", str(path))
        problems = list(decontaminated(problems, out, data_dir))
    return _write_checked(dedupe(problems) if remove_duplicates else problems, Path(data_dir) / f"{out}.jsonl")


def is_prepared(path: str | Path) -> bool:
    """Whether a file's first record is already a prepared problem (text "problem" and "answer" fields), as
    this script and other prepared copies write them; False for anything unreadable (reading says why later)."""
    try:
        _, first = next(iter(read_rows(path)))
    except (StopIteration, ValueError, OSError):
        return False
    return isinstance(first, dict) and isinstance(first.get("problem"), str) and "answer" in first


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("names", nargs="*", help=f"Hub datasets to download: {', '.join(HUB)}, or all")
    parser.add_argument(
        "--from", dest="source", metavar="FILE", help="convert this local .jsonl, .json or .parquet file"
    )
    parser.add_argument(
        "--layout",
        choices=[*LAYOUTS, *CODE_LAYOUTS],
        help="the --from file is a copy of this "
        "Hub dataset "
        "(default: the layout of --out when it is a Hub name and no key is given)",
    )
    parser.add_argument(
        "--problem-key",
        help="field holding the problem, dotted for nested fields such as "
        "prompt.0.content (with --from; default: problem)",
    )
    parser.add_argument(
        "--answer-key",
        help="field holding the answer, dotted for nested fields such as "
        "reward_model.ground_truth (with --from; default: answer)",
    )
    parser.add_argument("--out", help="name of the converted dataset: writes DATA_DIR/OUT.jsonl (with --from)")
    parser.add_argument("--dedupe", action="store_true", help="drop repeated (problem, answer) pairs (with --from)")
    parser.add_argument("--data-dir", default=str(DATA_DIR), help="where prepared datasets are written")
    args = parser.parse_args(argv)
    if bool(args.source) == bool(args.names):
        parser.error("give either dataset names to download or --from FILE --out NAME")
    if args.source and not args.out:
        parser.error("--from needs --out NAME")
    keys = args.problem_key is not None or args.answer_key is not None
    if args.layout and keys:
        parser.error("--layout and --problem-key/--answer-key are alternatives: give one")
    names = list(HUB) if args.names == ["all"] else args.names
    unknown = [name for name in names if name not in HUB]
    if unknown:
        parser.error(f"unknown datasets {unknown}; known: {', '.join(HUB)}, or all")
    layout = args.layout or (HUB[args.out][2] if args.out in HUB and not keys else None)
    try:
        if args.source:
            options = dict(
                problem_key=args.problem_key or "problem",
                answer_key=args.answer_key or "answer",
                remove_duplicates=args.dedupe,
                data_dir=args.data_dir,
            )
            try:
                convert_file(args.source, args.out, layout=layout, **options)
            except LayoutError:
                if args.layout or not is_prepared(args.source):
                    raise
                convert_file(args.source, args.out, **options)  # an already prepared copy, read as it is
        for name in names:
            download(name, args.data_dir)
    except (ValueError, OSError, ImportError) as e:
        parser.exit(2, f"prepare.py: {e}\n")


if __name__ == "__main__":
    main()
