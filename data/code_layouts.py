"""Code problems as datasets: their record format, checked, and the code datasets' Hub layouts.

A code problem has tests instead of an answer: {"problem", "task": "code", "style": "stdio" or "call",
"tests": [{"input", "output"}, ...], "fn_name" (call style), "tolerance" (when the statement gives one),
"case_sensitive": false (when the dataset's judge compares output tokens ignoring case), "id", "source"};
grading/sandbox.py runs a program against its tests. check_code_problem is the one check of
that format, for a prepared file (prepare.read_problems), a converted row and sandbox.py's inputs.

Each layout turns one row of a Hub dataset into such a record (APPS, TACO, CodeContests, Codeforces,
LiveCodeBench), or raises Skip for a problem these tests cannot grade: interactive ones, ones reading
or writing named files, ones needing a checker (several right answers: Codeforces' generated_checker,
or a statement that accepts any of several answers), ones without tests; prepare.convert_rows counts
the skips. Codeforces' checkers accept YES/yes/Yes where the statement says the answer may be printed
in any case, and CodeContests holds Codeforces' problems under the same judges: in those two layouts
such a statement makes the problem case-insensitive. APPS, TACO and LiveCodeBench grade by their own
harnesses, which compare case-sensitively, so their problems stay so. prepare.py holds the rest of reading, converting and downloading
datasets, math and code alike.
"""

import base64
import io
import json
import pickle
import re
import zlib

CODE_STYLES = ("stdio", "call")  # the test styles sandbox.py grades


def check_code_problem(problem: dict, where: str) -> None:
    """A ValueError naming `where` unless problem holds gradable tests: "tests", a non-empty list of
    {"input", "output"}; "style" stdio (input and output text) or call (input the argument list, output any
    JSON value, and "fn_name" the function to call); "tolerance", when present, a number >= 0; "case_sensitive",
    when present, a bool."""
    tests, style = problem.get("tests"), problem.get("style", "stdio")
    if style not in CODE_STYLES:
        raise ValueError(f"{where}: style must be one of {', '.join(CODE_STYLES)}, got {style!r}")
    if not isinstance(tests, list) or not tests:
        raise ValueError(f'{where}: a code problem needs "tests", a non-empty list of {{"input", "output"}}')
    name = problem.get("fn_name")
    if style == "call" and not (isinstance(name, str) and name.isidentifier()):
        raise ValueError(f'{where}: call-style tests need "fn_name", the function to call, got {name!r}')
    if not isinstance(problem.get("case_sensitive", True), bool):
        raise ValueError(f"{where}: case_sensitive must be true or false, got {problem['case_sensitive']!r}")
    tolerance = problem.get("tolerance")
    if tolerance is not None and (
        isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0
    ):
        raise ValueError(f"{where}: tolerance must be a number >= 0, got {tolerance!r}")
    for i, test in enumerate(tests):
        if not (isinstance(test, dict) and "input" in test and "output" in test):
            raise ValueError(f'{where}: test {i} is not an object with "input" and "output"')
        if style == "stdio" and not (isinstance(test["input"], str) and isinstance(test["output"], str)):
            raise ValueError(f"{where}: test {i}: stdio input and output must be text")
        if style == "call" and not isinstance(test["input"], list):
            raise ValueError(f"{where}: test {i}: a call test's input is the list of arguments")


class Skip(Exception):
    """A row that is a problem but not one these tests can grade (interactive, a special judge, no tests)."""


# "Your answer is correct if its absolute or relative error does not exceed 10^{-6}": judges that say so
_TOLERANCE_RE = re.compile(
    r"(?:absolute|relative)\s+(?:or\s+(?:absolute|relative)\s+)?error.{0,160}?"
    r"(?:10\s*\^\s*\{?\s*\(?\s*[-−]\s*(\d+)|1\s*[eE]\s*[-−]\s*(\d+))",
    re.I | re.S,
)
# "You may print each letter in any case (upper or lower)": a Codeforces judge then compares ignoring case
_ANY_CASE_RE = re.compile(
    r"\b(?:in|using) any (?:letter )?(?:case|register)\b|\bcase[- ]insensitive\b|\bany combination of (?:upper|lower)",
    re.I,
)
# "If there are multiple answers, print any of them": a right program may print another answer than the test's
_ANY_ANSWER_RE = re.compile(
    r"\b(?:multiple|several|many|more than one)\s+(?:possible\s+|valid\s+|correct\s+|optimal\s+|such\s+)?"
    r"(?:answers?|solutions?)\b[^.]{0,80}?\b(?:print|output|return|show)\s+any\b"
    r"|\b(?:print|output)\s+any\s+(?:one\s+)?of\s+them\b",
    re.I | re.S,
)
STDIO_NOTE = "Read the input from standard input and write the answer to standard output."


def tolerance_of(statement: str) -> float | None:
    """The float tolerance a statement states (absolute or relative error at most 10^-k), else None."""
    match = _TOLERANCE_RE.search(statement)
    return None if match is None else 10.0 ** -int(match[1] or match[2])


def accepts_any_case(statement: str) -> bool:
    """Whether a statement lets the answer be printed in any letter case (Codeforces' YES/yes convention)."""
    return _ANY_CASE_RE.search(statement) is not None


def code_problem(
    statement: str,
    tests: list[dict],
    source_id,
    *,
    fn_name: str | None = None,
    starter: str = "",
    judge_ignores_case: bool = False,
) -> dict:
    """The prepared record of a code problem. The statement gets what the program must do: read stdin and
    write stdout, or complete the starter code, whose function the tests call with their arguments.
    judge_ignores_case: the dataset's judge honours a statement's "in any case" (accepts_any_case), and
    the record then says case_sensitive false. A statement that accepts any of several answers needs a
    checker these tests do not have: Skip."""
    if not tests:
        raise Skip("no tests")
    if _ANY_ANSWER_RE.search(statement):
        raise Skip("needs a checker")
    statement = statement.strip()
    if fn_name:
        code = starter.strip() or f"def {fn_name}(...):"
        statement += f"\n\nComplete this code; each test calls {fn_name} with its arguments:\n```python\n{code}\n```"
    else:
        statement += "\n\n" + STDIO_NOTE
    record = {
        "problem": statement,
        "task": "code",
        "style": "call" if fn_name else "stdio",
        "tests": tests,
        "id": str(source_id),
    }
    if fn_name:
        record["fn_name"] = fn_name
    if (tolerance := tolerance_of(statement)) is not None:
        record["tolerance"] = tolerance
    if judge_ignores_case and accepts_any_case(statement):
        record["case_sensitive"] = False
    return record


def _lines(value) -> str:
    """APPS and TACO write some stdio inputs and outputs as lists of lines."""
    return "\n".join(value) if isinstance(value, list) else value


def apps_row(row: dict, index: int = 0) -> dict:
    """APPS and TACO: "question", "starter_code", and "input_output", a JSON string {"inputs", "outputs",
    "fn_name" for call style}. Call-style outputs come wrapped in a one-element list, as their checker unwraps."""
    if not row["input_output"]:
        raise Skip("no tests")
    io = json.loads(row["input_output"])
    name = io.get("fn_name")
    if name:
        tests = [
            {"input": list(args), "output": out[0] if isinstance(out, list) and len(out) == 1 else out}
            for args, out in zip(io["inputs"], io["outputs"])
        ]
    else:
        tests = [{"input": _lines(i), "output": _lines(o)} for i, o in zip(io["inputs"], io["outputs"])]
    return code_problem(
        row["question"], tests, row.get("problem_id", index), fn_name=name, starter=row.get("starter_code") or ""
    )


def code_contests_row(row: dict, index: int = 0) -> dict:
    """CodeContests: "description", and public, private and generated tests, each {"input": [...], "output": [...]}.
    Problems that read or write named files are skipped."""
    if row.get("input_file") or row.get("output_file"):
        raise Skip("reads or writes a file")
    tests = [
        {"input": i, "output": o}
        for kind in ("public_tests", "private_tests", "generated_tests")
        for i, o in zip((row.get(kind) or {}).get("input", []), (row.get(kind) or {}).get("output", []))
    ]
    return code_problem(row["description"], tests, row.get("name", index), judge_ignores_case=True)


def codeforces_row(row: dict, index: int = 0) -> dict:
    """open-r1/codeforces: title, description, input and output formats, examples, note, and "official_tests".
    Interactive problems, problems read from files and those with a checker (several right answers) are skipped."""
    if row.get("interaction_format"):
        raise Skip("interactive")
    if row.get("input_mode", "stdio") != "stdio":
        raise Skip("reads or writes a file")
    if row.get("generated_checker"):
        raise Skip("needs a checker")
    examples = "".join(
        f"\n\nExample input:\n{e['input']}\nExample output:\n{e['output']}" for e in row.get("examples") or []
    )
    parts = [
        row["title"],
        row["description"],
        f"Input\n{row.get('input_format') or ''}",
        f"Output\n{row.get('output_format') or ''}",
    ]
    statement = (
        "\n\n".join(p.strip() for p in parts) + examples + (f"\n\nNote\n{row['note']}" if row.get("note") else "")
    )
    tests = [{"input": t["input"], "output": t["output"]} for t in row.get("official_tests") or []]
    return code_problem(statement, tests, row.get("id", index), judge_ignores_case=True)


class _NoGlobals(pickle.Unpickler):
    """LiveCodeBench pickles a JSON string: an unpickler that builds nothing but plain values."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to build {module}.{name}")


def livecodebench_tests(text: str) -> list[dict]:
    """LiveCodeBench's test cases: a JSON list, or (code_generation_lite's private tests) that JSON pickled,
    zlib-compressed and base64-encoded. The pickle is read without building any object."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        packed = zlib.decompress(base64.b64decode(text.encode()))
        return json.loads(_NoGlobals(io.BytesIO(packed)).load())


def livecodebench_row(row: dict, index: int = 0) -> dict:
    """LiveCodeBench (code_generation_lite): "question_content", "starter_code", public and private test cases
    ({"input", "output", "testtype"}), and "metadata" with "func_name" for functional (LeetCode) problems,
    whose inputs are one JSON value per line, one line per argument."""
    tests = livecodebench_tests(row["public_test_cases"]) + livecodebench_tests(row["private_test_cases"])
    name = json.loads(row.get("metadata") or "{}").get("func_name")
    if name:
        tests = [
            {
                "input": [json.loads(line) for line in t["input"].split("\n") if line.strip()],
                "output": json.loads(t["output"]),
            }
            for t in tests
        ]
    else:
        tests = [{"input": t["input"], "output": t["output"]} for t in tests]
    return code_problem(
        row["question_content"],
        tests,
        row.get("question_id", index),
        fn_name=name,
        starter=row.get("starter_code") or "",
    )


CODE_LAYOUTS = {
    "apps": apps_row,
    "taco": apps_row,
    "code_contests": code_contests_row,
    "codeforces": codeforces_row,
    "livecodebench": livecodebench_row,
}
