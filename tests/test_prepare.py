"""Tests for data/prepare.py and data/code_layouts.py: strict dataset files, conversion of the Hub's layouts
(math and code) from local copies, downloads, and files as people have them."""

import json
import re
from pathlib import Path

import pytest

from conftest import DAPO_WRAPPER
from data import arithmetic_problems, code_layouts, load_problems, prepare

SHARED = Path(__file__).resolve().parent.parent / ".." / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data (third-party copies) not present")


def shared_rows(name: str) -> list[dict]:
    with open(SHARED / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------- reading dataset files


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"problem": "What is 1 + 1?", "answer": "2"', "invalid JSON"),
        ('{"problem": "What is 1 + 1?"}', "missing field 'answer'"),
        ('{"question": "What is 1 + 1?", "answer": "2"}', "missing field 'problem'"),
        ('{"problem": "   ", "answer": "2"}', "empty or non-text problem"),
        ('{"problem": "What is 1 + 1?", "answer": ""}', "empty or non-text answer"),
        ('{"problem": "What is 1 + 1?", "answer": null}', "empty or non-text answer"),
        ('["What is 1 + 1?", "2"]', "expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    good = '{"problem": "What is 2 + 2?", "answer": "4"}'
    path = write_lines(tmp_path / "set.jsonl", [good, "", bad_line, good])  # the blank line still counts
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: ") + ".*" + message):
        load_problems(path)


def test_reading_keeps_every_row_and_normalizes_answers(tmp_path):
    rows = [
        {"question": "What is 7 + 5?", "solution": 12},
        {"question": "Half of 55?", "solution": 27.5},
        {"question": " AMC ", "solution": 27.0, "id": "x"},
        {"question": "Two\u2028lines?", "solution": "a"},
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]  # raw U+2028 inside a string, as in GSM8K
    path = write_lines(tmp_path / "mine.jsonl", lines + ["", ""])
    problems = load_problems(path, problem_key="question", answer_key="solution")
    assert problems == [
        {"problem": "What is 7 + 5?", "answer": "12"},
        {"problem": "Half of 55?", "answer": "27.5"},
        {"problem": "AMC", "answer": "27", "id": "x"},
        {"problem": "Two\u2028lines?", "answer": "a"},
    ]


def test_json_list_files(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"problem": "a?", "answer": "1"}, {"problem": "b?", "answer": "2"}]))
    assert [p["answer"] for p in load_problems(path)] == ["1", "2"]
    path.write_text(json.dumps([{"problem": "a?", "answer": "1"}, {"problem": "b?"}]))
    with pytest.raises(ValueError, match=re.escape(f"{path}: item 1: missing field 'answer'")):
        load_problems(path)
    path.write_text('[{"problem": "a?",\n "answer": 1,}]')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: invalid JSON")):
        load_problems(path)


def test_empty_or_missing_files(tmp_path):
    with pytest.raises(ValueError, match="no problems"):
        load_problems(write_lines(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_problems(tmp_path / "nowhere.jsonl")


def test_names_resolve_to_prepared_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape("python data/prepare.py math500")):
        load_problems("math500", data_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown dataset 'mathh500'.*math500.*arithmetic_test"):
        load_problems("mathh500", data_dir=tmp_path)
    prepare.write_jsonl([{"problem": "p?", "answer": "1", "source": "here"}], tmp_path / "math500.jsonl")
    prepare.write_jsonl([{"problem": "q?", "answer": "2"}], tmp_path / "mine.jsonl")
    assert load_problems("math500", data_dir=tmp_path) == [{"problem": "p?", "answer": "1", "source": "here"}]
    assert load_problems("mine", data_dir=tmp_path)[0]["answer"] == "2"
    assert load_problems("arithmetic_test") == arithmetic_problems("test")
    assert load_problems("arithmetic") == arithmetic_problems("train")


# ---------------------------------------------------------------- conversion (offline)


@needs_shared
def test_shared_copies_load_with_their_documented_row_counts():
    counts = {
        "aime24": 30,
        "aime25": 30,
        "amc23": 40,
        "math500": 500,
        "gsm8k_test": 1319,
        "gsm8k_train": 7473,
        "dapo_math_17k": 17917,
    }
    for name, count in counts.items():
        assert len(load_problems(SHARED / f"{name}.jsonl")) == count, name


def located(rows: list[dict]) -> list[tuple[str, dict]]:
    return [(f"row {i}", row) for i, row in enumerate(rows)]


@needs_shared
def test_dapo_conversion_strips_the_wrapper_and_dedupes():
    shared = shared_rows("dapo_math_17k")

    def hub_row(row: dict, copy: int) -> dict:  # the Hub layout, a fresh index for every copy
        return {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_WRAPPER.format(row["problem"])}],
            "ability": "MATH",
            "reward_model": {"ground_truth": row["answer"], "style": "rule-based"},
            "extra_info": {"index": f"{row['id']}-{copy}"},
        }

    hub = [hub_row(row, copy) for copy in range(3) for row in shared]
    problems = list(prepare.convert_rows(located(hub), "dapo", "BytedTsinghua-SIA/DAPO-Math-17k"))
    distinct = list(dict.fromkeys((r["problem"].strip(), r["answer"]) for r in shared))
    assert len(shared) == 17917 and len(distinct) == 17267  # the file's rows vs its distinct problems
    assert [(p["problem"], p["answer"]) for p in problems] == distinct
    assert not any("Answer:" in p["problem"] and "$Answer" in p["problem"] for p in problems)
    with pytest.raises(ValueError, match="instruction wrapper"):
        prepare.strip_dapo_prompt("What is 1 + 1?")


def test_gsm8k_answer_is_the_number_after_the_marker():
    row = {
        "question": "A farm has 1,200 cows and buys 34 more. How many cows? ",
        "answer": "1,200 + 34 = <<1200+34=1234>>1,234 cows.\n#### 1,234",
    }
    (problem,) = prepare.convert_rows(located([row]), "gsm8k", "openai/gsm8k")
    assert problem == {"problem": row["question"].strip(), "answer": "1234", "source": "openai/gsm8k"}
    assert prepare.gsm8k_answer("She is left with -5 dollars.\n#### -5") == "-5"
    with pytest.raises(ValueError, match="without '####'"):
        prepare.gsm8k_answer("The answer is 5.")
    with pytest.raises(ValueError, match=r"row 0: GSM8K solution without '####'"):
        list(prepare.convert_rows(located([{"question": "q?", "answer": "5"}]), "gsm8k", "x"))


@needs_shared
def test_gsm8k_conversion_reproduces_the_shared_answers():
    shared = shared_rows("gsm8k_train")
    hub = [{"question": r["problem"], "answer": f"{r['solution']}\n#### {r['answer']}"} for r in shared]
    converted = prepare.convert_rows(located(hub), "gsm8k", "openai/gsm8k")
    assert [p["answer"] for p in converted] == [r["answer"] for r in shared]


@needs_shared
def test_math500_conversion_keeps_latex_answers(tmp_path):
    shared = shared_rows("math500")
    hub = [
        {
            "problem": r["problem"],
            "solution": "...",
            "answer": r["answer"],
            "subject": r["subject"],
            "level": r["level"],
            "unique_id": r["id"],
        }
        for r in shared
    ]
    path = tmp_path / "math500.jsonl"
    prepare.write_jsonl(prepare.convert_rows(located(hub), "math500", "HuggingFaceH4/MATH-500"), path)
    loaded = load_problems("math500", data_dir=tmp_path)
    assert [p["answer"] for p in loaded] == [r["answer"] for r in shared]
    assert loaded[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert sum("\\frac" in p["answer"] for p in loaded) > 50


def test_competition_answers_become_plain_integers():
    rows = [
        {"problem": "AIME 1", "answer": "025"},
        {"question": "AMC 1", "answer": 27.0},
        {"question": "AMC 2", "answer": "\\frac{1}{2}"},
        {"problem": "AIME 2", "answer": "000"},
        {"Problem": "AIME 3", "Answer": 204},
    ]  # Maxwell-Jia/AIME_2024's capitalized columns
    problems = list(prepare.convert_rows(located(rows), "aime", "mirror"))
    assert [p["answer"] for p in problems] == ["25", "27", "\\frac{1}{2}", "0", "204"]
    assert [p["problem"] for p in problems] == ["AIME 1", "AMC 1", "AMC 2", "AIME 2", "AIME 3"]


def test_cli_converts_a_local_file(tmp_path, capsys):
    source = tmp_path / "theirs.json"
    rows = [{"q": "What is 2 + 2?", "a": 4}, {"q": "What is 3 + 3?", "a": "6"}, {"q": "What is 2 + 2?", "a": 4}]
    source.write_text(json.dumps(rows))
    args = ["--from", str(source), "--problem-key", "q", "--answer-key", "a", "--data-dir", str(tmp_path)]
    prepare.main(args + ["--out", "mine"])
    assert [p["answer"] for p in load_problems("mine", data_dir=tmp_path)] == ["4", "6", "4"]
    prepare.main(args + ["--out", "mine", "--dedupe"])
    assert load_problems("mine", data_dir=tmp_path) == [
        {"problem": "What is 2 + 2?", "answer": "4", "source": str(source)},
        {"problem": "What is 3 + 3?", "answer": "6", "source": str(source)},
    ]
    assert "wrote 2 problems" in capsys.readouterr().out
    bad = write_lines(tmp_path / "bad.jsonl", ['{"q": "What is 2 + 2?", "a": 4}', '{"q": "What is 3 + 3?"}'])
    err = run_cli(
        ["--from", str(bad), "--problem-key", "q", "--answer-key", "a", "--out", "bad", "--data-dir", str(tmp_path)],
        capsys,
    )
    assert f"{bad}:2: missing field 'a'" in err
    assert not (tmp_path / "bad.jsonl.tmp").exists() and not (tmp_path / "bad.json").exists()


def test_download_converts_the_snapshot_files_in_order(tmp_path, monkeypatch):
    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    write_lines(snapshot / "aime2025-I.jsonl", [json.dumps({"question": "First?", "answer": "070"})])
    write_lines(snapshot / "aime2025-II.jsonl", [json.dumps({"question": "Second?", "answer": "588"})])
    write_lines(snapshot / "README.md", ["not data"])
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    prepare.main(["aime25", "--data-dir", str(tmp_path)])
    assert calls == [("opencompass/AIME2025", {"repo_type": "dataset", "allow_patterns": "aime2025-*.jsonl"})]
    assert load_problems("aime25", data_dir=tmp_path) == [
        {"problem": "First?", "answer": "70", "source": "opencompass/AIME2025"},
        {"problem": "Second?", "answer": "588", "source": "opencompass/AIME2025"},
    ]


def test_download_reads_dapo_parquet_with_its_nesting_and_repeats(tmp_path, monkeypatch):
    import huggingface_hub
    import pyarrow as pa
    import pyarrow.parquet as pq

    snapshot = tmp_path / "snapshot" / "data"
    snapshot.mkdir(parents=True)
    prompt = prepare.DAPO_PREFIX + "{}" + prepare.DAPO_SUFFIX
    rows = [
        {"prompt": [{"role": "user", "content": prompt.format(q)}], "reward_model": {"ground_truth": a}}
        for q, a in [("What is 1 + 1?", "2"), ("Find x if 2x = 6.", "3")]
    ] * 3  # the hub repeats rows
    pq.write_table(pa.Table.from_pylist(rows), snapshot / "dapo-math-17k.parquet")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **kw: str(snapshot.parent))
    prepare.main(["dapo", "--data-dir", str(tmp_path)])
    problems = load_problems("dapo", data_dir=tmp_path)
    assert [(p["problem"], p["answer"]) for p in problems] == [("What is 1 + 1?", "2"), ("Find x if 2x = 6.", "3")]


def test_download_offline_says_how_to_convert_instead(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # never touch the network, even where there is one
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit):
        prepare.main(["math500", "--data-dir", str(tmp_path)])
    assert re.search(r"cannot download HuggingFaceH4/MATH-500(.|\n)*--from FILE --out math500", capsys.readouterr().err)
    assert not (tmp_path / "math500.jsonl").exists()


# ---------------------------------------------------------------- local copies of Hub files (--from)

DAPO_ROWS = [  # the Hub layout; the file repeats every row
    {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_WRAPPER.format(q), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": a, "style": "rule-based"},
        "extra_info": {"index": f"id-{i}"},
    }
    for i, (q, a) in enumerate([("What is 1 + 1?", "2"), ("Find x if 2x = 6.", "3")] * 2)
]


def openmath_row(problem: str, solution: str, expected: str) -> dict:
    """A row in OpenMathReasoning's layout (its cot split)."""
    return {
        "expected_answer": expected,
        "problem_type": "has_answer_extracted",
        "problem_source": "aops_c4",
        "generation_model": "DeepSeek-R1",
        "pass_rate_72b_tir": "0.9",
        "problem": problem,
        "generated_solution": solution,
        "inference_mode": "cot",
        "used_in_kaggle": False,
    }


OPENMATH_ROWS = [
    openmath_row("Compute $2+3$.", "<think>\n2 + 3 is 5.\n</think>\n\nAdding, $2+3=\\boxed{5}$.", "5"),
    openmath_row("Compute $2+4$.", "<think>\nIt is 6.\n</think>\n\nSo $\\boxed{7}$.", "6"),  # reaches another answer
    # right only while thinking
    openmath_row("Compute $2+5$.", "<think>\n\\boxed{7}?\n</think>\n\nSo $\\boxed{8}$.", "7"),
    openmath_row("Prove it.", "<think>\nA proof.\n</think>\n\nDone.", ""),  # no expected answer
]

# dataset name -> (rows in its Hub layout, the prepared (problem, answer) pairs)
HUB_COPIES = {
    "gsm8k": (
        [
            {"question": "Tom has 3 bags of 6 apples. How many apples?", "answer": "3 * 6 = <<3*6=18>>18\n#### 18"},
            {"question": "A shop sells 1,000 pens and 250 more.", "answer": "1,000 + 250 = 1,250\n#### 1,250"},
        ],
        [("Tom has 3 bags of 6 apples. How many apples?", "18"), ("A shop sells 1,000 pens and 250 more.", "1250")],
    ),
    "math500": (
        [
            {
                "problem": "Simplify $\\frac{28}{6}$.",
                "solution": "It is $\\boxed{\\frac{14}{3}}$.",
                "answer": "\\frac{14}{3}",
                "subject": "Algebra",
                "level": 2,
                "unique_id": "test/algebra/1.json",
            }
        ],
        [("Simplify $\\frac{28}{6}$.", "\\frac{14}{3}")],
    ),
    "aime24": (
        [
            {
                "id": 60,
                "problem": "Find the remainder.",
                "solution": "...",
                "answer": "033",
                "url": "https://artofproblemsolving.com/wiki",
                "year": "2024",
            }
        ],
        [("Find the remainder.", "33")],
    ),
    "aime25": ([{"question": "Find the sum of all bases.", "answer": "70"}], [("Find the sum of all bases.", "70")]),
    "amc23": (
        [{"id": 0, "question": "Cities A and B are 45 miles apart.", "answer": 27.0, "url": "https://aops"}],
        [("Cities A and B are 45 miles apart.", "27")],
    ),
    "amc83": (  # AI-MO/aimo-validation-amc: AMC 12 2022 and 2023, answers stored as floats
        [{"id": 82, "problem": "Flora the frog starts at 0.", "answer": 3.0, "url": "https://aops"}],
        [("Flora the frog starts at 0.", "3")],
    ),
    "dapo": (DAPO_ROWS, [("What is 1 + 1?", "2"), ("Find x if 2x = 6.", "3")]),
    "brumo25": (
        [
            {"problem_idx": 1, "problem": "Compute $2+3$.", "answer": "5", "problem_type": ["Algebra"]},
            {"problem_idx": 2, "problem": "Find the ratio.", "answer": "\\frac{3}{4}", "problem_type": ["Geometry"]},
        ],
        [("Compute $2+3$.", "5"), ("Find the ratio.", "\\frac{3}{4}")],
    ),
    "smt25": (
        [{"problem_idx": 7, "problem": "How many subsets?", "answer": "012", "problem_type": ["Combinatorics"]}],
        [("How many subsets?", "12")],
    ),
    "openmath": (OPENMATH_ROWS, [("Compute $2+3$.", "5")]),
    "gsm8k_sft": (
        [
            {
                "question": "Tom has 3 bags of 6 apples. How many apples?",
                "answer": "Each bag has 6.\n3 * 6 = <<3*6=18>>18 apples.\n#### 18",
            }
        ],
        [("Tom has 3 bags of 6 apples. How many apples?", "18")],
    ),
    "math_sft": (
        [
            {
                "problem": "Simplify $\\frac{28}{6}$.",
                "level": "Level 2",
                "type": "Algebra",
                "solution": "Divide both by 2: $\\frac{28}{6} = \\boxed{\\frac{14}{3}}$.",
            }
        ],
        [("Simplify $\\frac{28}{6}$.", "\\frac{14}{3}")],
    ),
}


def write_copy(path: Path, rows: list[dict]) -> Path:
    """rows in path's format: a parquet table, one JSON list (.json), or JSON lines."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        write_lines(path, [json.dumps(row) for row in rows])
    return path


def run_cli(args: list[str], capsys) -> str:
    """prepare.main for a run that must fail as a user error: exit status 2, one line on stderr; returns it."""
    with pytest.raises(SystemExit) as exit_info:
        prepare.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("prepare.py: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
@pytest.mark.parametrize("name", list(HUB_COPIES))
def test_cli_converts_hub_copies_by_dataset_name(tmp_path, name, suffix):
    rows, expected = HUB_COPIES[name]
    source = write_copy(tmp_path / f"copy{suffix}", rows)
    prepare.main(["--from", str(source), "--out", name, "--data-dir", str(tmp_path)])
    problems = load_problems(name, data_dir=tmp_path)
    assert [(p["problem"], p["answer"]) for p in problems] == expected
    assert {p["source"] for p in problems} == {str(source)}


def test_solution_sets_keep_a_worked_solution_that_reaches_the_answer(tmp_path, capsys):
    for name in ("openmath", "gsm8k_sft", "math_sft"):
        source = write_copy(tmp_path / f"{name}.parquet", HUB_COPIES[name][0])
        prepare.main(["--from", str(source), "--out", name, "--data-dir", str(tmp_path)])
    assert "kept 1 of 4 solutions" in capsys.readouterr().out
    assert load_problems("openmath", data_dir=tmp_path)[0]["solution"].startswith("<think>\n2 + 3 is 5.")
    assert load_problems("gsm8k_sft", data_dir=tmp_path)[0]["solution"] == "Each bag has 6.\n3 * 6 = 18 apples."
    assert load_problems("math_sft", data_dir=tmp_path)[0]["solution"].endswith("\\boxed{\\frac{14}{3}}$.")
    source = write_copy(tmp_path / "brumo.parquet", HUB_COPIES["brumo25"][0])
    prepare.main(["--from", str(source), "--out", "brumo25", "--data-dir", str(tmp_path)])
    assert [p["id"] for p in load_problems("brumo25", data_dir=tmp_path)] == [1, 2]  # eval.py pairs runs by id


def test_layout_flag_converts_into_any_name(tmp_path):
    source = write_copy(tmp_path / "test-00000-of-00001.parquet", HUB_COPIES["gsm8k"][0])
    prepare.main(["--from", str(source), "--layout", "gsm8k", "--out", "mine", "--data-dir", str(tmp_path)])
    assert [p["answer"] for p in load_problems("mine", data_dir=tmp_path)] == ["18", "1250"]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_dotted_keys_read_the_dapo_layout_and_unwrap_it(tmp_path, suffix):
    source = write_copy(tmp_path / f"dapo{suffix}", DAPO_ROWS)
    prepare.main(
        [
            "--from",
            str(source),
            "--problem-key",
            "prompt.0.content",
            "--answer-key",
            "reward_model.ground_truth",
            "--out",
            "mine",
            "--dedupe",
            "--data-dir",
            str(tmp_path),
        ]
    )
    problems = load_problems("mine", data_dir=tmp_path)
    assert [(p["problem"], p["answer"]) for p in problems] == HUB_COPIES["dapo"][1]
    # the fields the keys did not use are kept, the ones they used are not
    assert problems[0]["extra_info"] == {"index": "id-0"}
    assert "prompt" not in problems[0] and "reward_model" not in problems[0]


def test_keys_on_a_gsm8k_copy_take_the_final_answer(tmp_path):
    source = write_copy(tmp_path / "gsm8k.jsonl", HUB_COPIES["gsm8k"][0])
    prepare.main(
        [
            "--from",
            str(source),
            "--problem-key",
            "question",
            "--answer-key",
            "answer",
            "--out",
            "mine",
            "--data-dir",
            str(tmp_path),
        ]
    )
    assert [p["answer"] for p in load_problems("mine", data_dir=tmp_path)] == ["18", "1250"]
    parquet = write_copy(tmp_path / "gsm8k.parquet", HUB_COPIES["gsm8k"][0])
    assert [p["answer"] for p in load_problems(parquet, problem_key="question")] == ["18", "1250"]


def test_field_reaches_into_nested_objects_and_lists():
    record = {"a.b": 1, "a": {"b": 2, "c": [{"d": "x"}]}}
    assert prepare.field(record, "a.b") == 1  # a field named with a dot wins over the path
    assert prepare.field(record, "a.c.0.d") == "x"
    for missing in ("a.c.1.d", "a.x", "a.c.d", "z"):
        with pytest.raises(KeyError):
            prepare.field(record, missing)


def test_unreadable_files_name_the_file_and_the_format(tmp_path, capsys):
    parquet_as_jsonl = write_copy(tmp_path / "g.parquet", HUB_COPIES["gsm8k"][0]).rename(tmp_path / "g.jsonl")
    err = run_cli(["--from", str(parquet_as_jsonl), "--out", "gsm8k", "--data-dir", str(tmp_path)], capsys)
    assert f"{parquet_as_jsonl}: cannot read as JSON lines: not UTF-8 text" in err and "name it .parquet" in err
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    err = run_cli(["--from", str(broken), "--out", "gsm8k", "--data-dir", str(tmp_path)], capsys)
    assert f"{broken}: cannot read as parquet" in err
    csv = write_lines(tmp_path / "gsm8k.csv", ["question,answer"])
    err = run_cli(["--from", str(csv), "--out", "gsm8k", "--data-dir", str(tmp_path)], capsys)
    assert "gsm8k.csv: unknown file type '.csv'; expected .jsonl, .json or .parquet" in err
    assert not list(tmp_path.glob("gsm8k.jsonl*"))


def test_a_copy_in_another_layout_is_named_with_its_fields(tmp_path, capsys):
    other = write_copy(tmp_path / "other.parquet", [{"text": "What is 2 + 2?", "label": "4"}])
    err = run_cli(["--from", str(other), "--out", "gsm8k", "--data-dir", str(tmp_path)], capsys)
    assert (
        f"{other}: row 0: not a row of the gsm8k layout (KeyError: 'question'; fields: text, label); "
        "for a file in another layout give --problem-key and --answer-key" in err
    )
    source = write_copy(tmp_path / "mine.parquet", [{"problem": "What is 2 + 2?", "answer": "4"}])
    err = run_cli(
        ["--from", str(source), "--problem-key", "prompt.0.content", "--out", "x", "--data-dir", str(tmp_path)], capsys
    )
    assert f"{source}: row 0: missing field 'prompt.0.content'" in err
    prepare.main(["--from", str(source), "--problem-key", "problem", "--out", "gsm8k", "--data-dir", str(tmp_path)])
    assert load_problems("gsm8k", data_dir=tmp_path)[0]["answer"] == "4"  # keys given: no layout by name
    with pytest.raises(SystemExit):
        prepare.main(["--from", str(source), "--layout", "gsm8k", "--answer-key", "a", "--out", "x"])
    assert "--layout and --problem-key/--answer-key are alternatives" in capsys.readouterr().err


# ---------------------------------------------------------------- code datasets: local copies of each Hub layout


def lcb_packed(tests: list[dict]) -> str:
    """LiveCodeBench's encoding of private tests: a pickled JSON string, zlib-compressed, base64."""
    import base64
    import pickle
    import zlib

    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


APPS_ROWS = [
    {
        "problem_id": 4000,
        "question": "Read a and b and print a + b.",
        "solutions": "[]",
        "difficulty": "introductory",
        "url": "https://codeforces.com",
        "starter_code": "",
        "input_output": json.dumps({"inputs": ["1 2\n", ["3", "4"]], "outputs": ["3\n", ["7"]]}),
    },
    {
        "problem_id": 4001,
        "question": "Return the list doubled.",
        "solutions": "[]",
        "difficulty": "introductory",
        "url": "https://www.codewars.com",
        "starter_code": "def double(xs):\n\t",
        "input_output": json.dumps({"fn_name": "double", "inputs": [[[1, 2]], [[]]], "outputs": [[[2, 4]], [[]]]}),
    },
    {
        "problem_id": 4002,
        "question": "No tests here.",
        "solutions": "[]",
        "difficulty": "interview",
        "url": "",
        "starter_code": "",
        "input_output": "",
    },
]
CODE_COPIES = {  # name -> (rows in its Hub layout, file suffix, [(style, fn_name, tests, tolerance, id)], solutions)
    "apps": (
        APPS_ROWS,
        ".jsonl",
        [
            ("stdio", None, [{"input": "1 2\n", "output": "3\n"}, {"input": "3\n4", "output": "7"}], None, "4000"),
            ("call", "double", [{"input": [[1, 2]], "output": [2, 4]}, {"input": [[]], "output": []}], None, "4001"),
        ],
        ["a, b = map(int, open(0).read().split())\nprint(a + b)", "def double(xs):\n    return [2 * x for x in xs]"],
    ),
    "taco": (
        [
            {**row, "name": f"p{i}", "source": "codewars", "time_limit": "1 second", "tags": "[]"}
            for i, row in enumerate(({k: v for k, v in r.items() if k != "problem_id"} for r in APPS_ROWS))
        ],
        ".parquet",
        [
            ("stdio", None, [{"input": "1 2\n", "output": "3\n"}, {"input": "3\n4", "output": "7"}], None, "0"),
            ("call", "double", [{"input": [[1, 2]], "output": [2, 4]}, {"input": [[]], "output": []}], None, "1"),
        ],
        ["a, b = map(int, open(0).read().split())\nprint(a + b)", "def double(xs):\n    return [2 * x for x in xs]"],
    ),
    "code_contests": (
        [
            {
                "name": "1_A. Third",
                "description": "Print a / b. Your answer is correct if its absolute or relative error "
                "does not exceed 10^{-6}.",
                "public_tests": {"input": ["1 3\n"], "output": ["0.3333333333\n"]},
                "private_tests": {"input": ["2 4\n"], "output": ["0.5\n"]},
                "generated_tests": {"input": ["9 9\n"], "output": ["1.0\n"]},
                "source": 2,
                "difficulty": 7,
                "input_file": "",
                "output_file": "",
                "time_limit": {"seconds": 2, "nanos": 0},
            },
            {
                "name": "2_B. Files",
                "description": "Read input.txt.",
                "public_tests": {"input": ["1\n"], "output": ["1\n"]},
                "private_tests": {"input": [], "output": []},
                "generated_tests": {"input": [], "output": []},
                "source": 2,
                "difficulty": 7,
                "input_file": "input.txt",
                "output_file": "output.txt",
                "time_limit": None,
            },
        ],
        ".parquet",
        [
            (
                "stdio",
                None,
                [
                    {"input": "1 3\n", "output": "0.3333333333\n"},
                    {"input": "2 4\n", "output": "0.5\n"},
                    {"input": "9 9\n", "output": "1.0\n"},
                ],
                1e-6,
                "1_A. Third",
            )
        ],
        ["a, b = map(int, input().split())\nprint(round(a / b, 7))"],
    ),
    "codeforces": (
        [
            {
                "id": "2000A",
                "title": "Double",
                "description": "Given n, print 2n.",
                "input_format": "One integer n.",
                "output_format": "One integer.",
                "interaction_format": None,
                "note": None,
                "examples": [{"input": "2\n", "output": "4\n"}],
                "official_tests": [{"input": "2\n", "output": "4\n"}, {"input": "7\n", "output": "14\n"}],
                "official_tests_complete": True,
                "input_mode": "stdio",
                "generated_checker": None,
                "rating": 800,
            },
            {
                "id": "2000B",
                "title": "Guess",
                "description": "Guess the number.",
                "input_format": "",
                "output_format": "",
                "interaction_format": "Ask queries.",
                "note": None,
                "examples": [],
                "official_tests": [],
                "official_tests_complete": True,
                "input_mode": "stdio",
                "generated_checker": None,
                "rating": 1200,
            },
            {
                "id": "2000C",
                "title": "Any",
                "description": "Print any divisor.",
                "input_format": "",
                "output_format": "",
                "interaction_format": None,
                "note": None,
                "examples": [],
                "official_tests": [{"input": "6\n", "output": "2\n"}],
                "official_tests_complete": True,
                "input_mode": "stdio",
                "generated_checker": "import sys",
                "rating": 900,
            },
        ],
        ".parquet",
        [("stdio", None, [{"input": "2\n", "output": "4\n"}, {"input": "7\n", "output": "14\n"}], None, "2000A")],
        ["print(2 * int(input()))"],
    ),
    "livecodebench": (
        [
            {
                "question_title": "Triple",
                "question_content": "Print 3n.",
                "platform": "atcoder",
                "question_id": "abc1_a",
                "contest_id": "abc1",
                "contest_date": "2024-08-03T00:00:00",
                "starter_code": "",
                "difficulty": "easy",
                "public_test_cases": json.dumps([{"input": "2\n", "output": "6\n", "testtype": "stdin"}]),
                "private_test_cases": lcb_packed([{"input": "5\n", "output": "15\n", "testtype": "stdin"}]),
                "metadata": "{}",
            },
            {
                "question_title": "Two Sum",
                "question_content": "Return the indices.",
                "platform": "leetcode",
                "question_id": "1",
                "contest_id": "w1",
                "contest_date": "2024-08-04T00:00:00",
                "difficulty": "easy",
                "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
                "public_test_cases": json.dumps(
                    [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional"}]
                ),
                "private_test_cases": json.dumps(
                    [{"input": "[3, 3]\n6", "output": "[0, 1]", "testtype": "functional"}]
                ),
                "metadata": json.dumps({"func_name": "twoSum"}),
            },
        ],
        ".jsonl",
        [
            ("stdio", None, [{"input": "2\n", "output": "6\n"}, {"input": "5\n", "output": "15\n"}], None, "abc1_a"),
            (
                "call",
                "twoSum",
                [{"input": [[2, 7, 11, 15], 9], "output": [0, 1]}, {"input": [[3, 3], 6], "output": [0, 1]}],
                None,
                "1",
            ),
        ],
        [
            "print(3 * int(input()))",
            "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        return [0, 1]",
        ],
    ),
}


@pytest.mark.parametrize("name", list(CODE_COPIES))
def test_code_layouts_convert_local_copies(tmp_path, name, capsys):
    rows, suffix, expected, _ = CODE_COPIES[name]
    source = write_copy(tmp_path / f"copy{suffix}", rows)
    prepare.main(["--from", str(source), "--out", name, "--data-dir", str(tmp_path)])
    problems = load_problems(name, data_dir=tmp_path)
    assert [(p["style"], p.get("fn_name"), p["tests"], p.get("tolerance"), p["id"]) for p in problems] == expected
    assert all(p["task"] == "code" and p["source"] == str(source) for p in problems)
    for p, (style, fn_name, *_rest) in zip(problems, expected):
        assert (code_layouts.STDIO_NOTE in p["problem"]) == (style == "stdio")
        assert fn_name is None or f"Complete this code; each test calls {fn_name}" in p["problem"]
    if len(rows) > len(expected):
        assert "skipped" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(CODE_COPIES))
def test_converted_code_problems_grade_their_reference_solutions(tmp_path, name):
    """A right solution passes every converted test, and a wrong one does not: the layouts keep tests gradable."""
    from grading import sandbox

    rows, suffix, _, solutions = CODE_COPIES[name]
    prepare.main(
        ["--from", str(write_copy(tmp_path / f"copy{suffix}", rows)), "--out", name, "--data-dir", str(tmp_path)]
    )
    problems = load_problems(name, data_dir=tmp_path)
    try:
        grades = sandbox.grade(solutions + ["print(0)"] * len(problems), problems * 2, workers=2)
    except sandbox.SandboxUnavailable as error:
        pytest.skip(str(error))
    assert [g.reason for g in grades[: len(problems)]] == [None] * len(problems)
    assert all(g.reason is not None for g in grades[len(problems) :])


def test_livecodebench_pickles_never_build_objects(tmp_path, capsys):
    import base64
    import pickle
    import zlib

    class Payload:
        def __reduce__(self):
            return (print, ("built",))

    row = {
        **CODE_COPIES["livecodebench"][0][0],
        "private_test_cases": base64.b64encode(zlib.compress(pickle.dumps(Payload()))).decode(),
    }
    source = write_copy(tmp_path / "lcb.jsonl", [row])
    err = run_cli(["--from", str(source), "--out", "livecodebench", "--data-dir", str(tmp_path)], capsys)
    assert "refusing to build builtins.print" in err and f"{source}:1" in err
    assert not (tmp_path / "livecodebench.jsonl").exists()


def test_tolerance_is_read_from_the_statement():
    for statement, tolerance in [
        ("absolute or relative error does not exceed $$$10^{-6}$$$", 1e-6),
        ("The relative error must be at most 1e-4.", 1e-4),
        ("if the absolute error is less than 10^(-9)", 1e-9),
        ("Print the answer modulo 10^9+7.", None),
        ("no numbers", None),
    ]:
        assert code_layouts.tolerance_of(statement) == tolerance, statement


def test_case_is_ignored_where_the_dataset_s_judge_ignores_it():
    any_case = "Print YES or NO. You can output the answer in any case (upper or lower)."
    row = {**CODE_COPIES["codeforces"][0][0], "output_format": any_case}
    assert code_layouts.codeforces_row(row)["case_sensitive"] is False
    contest = {**CODE_COPIES["code_contests"][0][0], "description": any_case}
    assert code_layouts.code_contests_row(contest)["case_sensitive"] is False
    plain = {**CODE_COPIES["codeforces"][0][0], "output_format": "Print YES or NO."}
    assert "case_sensitive" not in code_layouts.codeforces_row(plain)
    # APPS and TACO grade by their own harness, which compares case-sensitively, whatever the statement says
    apps = {**APPS_ROWS[0], "question": any_case}
    assert "case_sensitive" not in code_layouts.apps_row(apps)


def test_a_statement_that_accepts_any_answer_is_skipped_and_counted_per_set(tmp_path, capsys):
    rows = [
        {**CODE_COPIES["codeforces"][0][0], "id": "1A", "output_format": "If there are multiple answers, print any."},
        {**CODE_COPIES["codeforces"][0][0], "id": "1B", "note": "If there are several solutions, output any of them."},
        {**CODE_COPIES["codeforces"][0][0], "id": "1C", "generated_checker": "int main() {}"},
        CODE_COPIES["codeforces"][0][0],
    ]
    source = write_copy(tmp_path / "cf.parquet", rows)
    prepare.main(["--from", str(source), "--out", "codeforces", "--data-dir", str(tmp_path)])
    assert f"{source}: skipped 3 problems these tests cannot grade: 3 needs a checker" in capsys.readouterr().out
    assert [p["id"] for p in load_problems("codeforces", data_dir=tmp_path)] == ["2000A"]


def code_record(statement: str, index: int) -> dict:
    return code_layouts.code_problem(statement, [{"input": "1\n", "output": "1\n"}], index)


LEGEND = (
    "Little Vasya has n boxes standing in a row, the i-th of them holds a_i candies. Each minute he may take one "
    "candy from a box whose neighbour holds more candies than it. Find the least number of minutes after which no "
    "box can give a candy away."
)


def test_decontamination_removes_exact_and_near_repeats_of_the_benchmarks():
    index = prepare.benchmark_index(
        [
            ("codeforces", code_record(LEGEND, 0)["problem"]),
            ("apps", "Given two integers, print their sum."),  # below NGRAM words: matched only exactly
        ]
        + [
            ("taco", f"{i} The first line of the input contains a single integer n, the number of test cases.")
            for i in range(30)
        ]
    )
    same = LEGEND.upper().replace(",", " ,")  # case, punctuation and spacing aside, the same words
    reworded = LEGEND.replace("Little Vasya", "Petya").replace("least number of minutes", "minimum time")
    assert prepare.duplicate_of(same, index) == ("exact", "codeforces")
    assert prepare.duplicate_of(reworded, index) == ("near", "codeforces")
    assert prepare.duplicate_of("Given two integers, print their sum.", index) == ("exact", "apps")
    assert prepare.duplicate_of("Given two integers, print their product.", index) is None
    # boilerplate shared with 30 benchmark statements is no evidence of a repeat
    other = "The first line of the input contains a single integer n, the number of test cases. Print n squared."
    assert prepare.duplicate_of(other, index) is None
    # a call-style copy of a stdio problem compares by its statement: the appended notes are left out
    call = code_layouts.code_problem(LEGEND, [{"input": [1], "output": 1}], 9, fn_name="minutes")
    assert prepare.duplicate_of(call["problem"], index) == ("exact", "codeforces")


def test_the_code_training_set_is_decontaminated_against_every_evaluated_set(tmp_path, capsys):
    rows = [
        {**APPS_ROWS[0], "question": LEGEND},
        {**APPS_ROWS[0], "question": LEGEND.replace("Little Vasya", "Petya")},
        {**APPS_ROWS[0], "question": "Given two integers, print their sum."},
    ]
    source = write_copy(tmp_path / "train.parquet", rows)
    message = run_cli(["--from", str(source), "--out", "taco_train", "--data-dir", str(tmp_path)], capsys)
    assert "prepare taco, apps, code_contests, codeforces, livecodebench first" in message
    assert not (tmp_path / "taco_train.jsonl").exists()
    for i, name in enumerate(prepare.CODE_BENCHMARKS):
        statement = LEGEND if name == "codeforces" else f"Benchmark {name} problem {i}: print the {name} of the input."
        prepare.write_jsonl([code_record(statement, i)], tmp_path / f"{name}.jsonl")
    prepare.main(["--from", str(source), "--out", "taco_train", "--data-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "taco_train: removed 2 of 3 problems that repeat an evaluated code set's statement" in out
    assert "(1 exact, 1 near-duplicate; 2 codeforces)" in out
    kept = load_problems("taco_train", data_dir=tmp_path)
    assert [p["problem"].split("\n\n")[0] for p in kept] == ["Given two integers, print their sum."]


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"problem": "p", "task": "code", "tests": [{"input": "1", "output": "1"}], "case_sensitive": "no"},
            "case_sensitive",
        ),
        ({"problem": "p", "task": "code", "tests": []}, "non-empty list"),
        ({"problem": "p", "task": "code", "tests": [{"input": "1"}]}, "test 0"),
        ({"problem": "", "task": "code", "tests": [{"input": "1", "output": "1"}]}, "empty or non-text problem"),
        ({"problem": "p", "task": "code", "style": "call", "tests": [{"input": [1], "output": 2}]}, "fn_name"),
    ],
)
def test_malformed_code_records_name_file_and_line(tmp_path, record, message):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"problem": "ok", "answer": "1"}), json.dumps(record)])
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        load_problems(path)


# ---------------------------------------------------------------- files as people have them


def test_a_byte_order_mark_is_not_data(tmp_path):
    for suffix in (".jsonl", ".json"):
        path = tmp_path / f"bom{suffix}"
        path.write_bytes(b"\xef\xbb\xbf" + '{"problem": "What is 2 + 2?", "answer": "4"}\n'.encode())
        assert load_problems(path) == [{"problem": "What is 2 + 2?", "answer": "4"}]


def test_an_object_holding_one_list_of_records_is_read_as_those_records(tmp_path):
    path = tmp_path / "wrapped.json"
    path.write_text(
        json.dumps(
            {
                "version": 2,
                "data": [{"problem": "What is 2 + 2?", "answer": "4"}, {"problem": "What is 3 + 3?", "answer": 6}],
            }
        )
    )
    assert [p["answer"] for p in load_problems(path)] == ["4", "6"]
    path.write_text(json.dumps({"data": [{"problem": "What is 2 + 2?"}]}))
    with pytest.raises(ValueError, match=r"wrapped.json: data item 0: missing field 'answer'"):
        load_problems(path)
    path.write_text(json.dumps({"train": [], "test": []}))
    with pytest.raises(
        ValueError,
        match=r"one JSON object holding 2 lists \(train, test\); expected a list of "
        r"records, JSON lines, or an object whose one list holds the records",
    ):
        load_problems(path)
    path.write_text('{"problem": "What is 2 + 2?", "answer": "4"}\n{"problem": "What is 1 + 1?", "answer": "2"}\n')
    assert len(load_problems(path)) == 2, "JSON lines named .json still read line by line"
    path.write_text('{"problem": "Which is prime?", "answer": "B", "choices": ["4", "5"]}')
    assert load_problems(path)[0]["choices"] == ["4", "5"], "a record's own list is not a list of records"


def test_a_prepared_copy_converts_under_a_hub_name_without_keys(tmp_path, capsys):
    """The shared copies are already prepared (problem, answer, solution, ...): --out gsm8k reads them as they are."""
    source = write_copy(
        tmp_path / "gsm8k_test.jsonl",
        [{"problem": "Janet has 3 apples...", "answer": "18", "id": "gsm8k-test-0", "solution": "3 * 6 = 18"}],
    )
    prepare.main(["--from", str(source), "--out", "gsm8k", "--data-dir", str(tmp_path)])
    assert load_problems("gsm8k", data_dir=tmp_path) == [
        {
            "problem": "Janet has 3 apples...",
            "answer": "18",
            "id": "gsm8k-test-0",
            "solution": "3 * 6 = 18",
            "source": str(source),
        }
    ]
