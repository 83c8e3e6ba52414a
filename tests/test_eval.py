"""Tests for eval.py: estimators against hand-computed values, comparisons, run files, and an end-to-end eval."""

import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import eval as ev


def problem(
    pid: str,
    correct: list[int],
    answers: list[str | None] | None = None,
    lengths: list[int] | None = None,
    truncated: list[bool] | None = None,
) -> ev.ProblemResult:
    n = len(correct)
    return ev.ProblemResult(
        id=pid,
        reference="0",
        completions=[""] * n,
        answers=answers if answers is not None else ["0" if c else "1" for c in correct],
        correct=[bool(c) for c in correct],
        lengths=lengths or [10] * n,
        truncated=truncated or [False] * n,
    )


def evaluation(rows: dict[str, list[int]], k: int) -> ev.Evaluation:
    problems = [problem(pid, correct) for pid, correct in rows.items()]
    return ev.Evaluation(k, problems, ev.summarize(problems, k))


# -----------------------------------------------------------------------------
# pass@k, mean@k, maj@k


def test_pass_at_k_hand_values():
    # 8 samples, 2 correct, k=4: the 4-subsets with no correct sample are C(6,4)=15 of C(8,4)=70
    assert ev.pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70, rel=1e-12)
    assert ev.pass_at_k(8, 2, 4) == pytest.approx(55 / 70, rel=1e-12)
    for c in range(9):
        assert ev.pass_at_k(8, c, 1) == pytest.approx(c / 8, rel=1e-12, abs=1e-15)
    assert ev.pass_at_k(8, 0, 8) == 0.0
    assert ev.pass_at_k(8, 8, 8) == 1.0
    assert ev.pass_at_k(8, 1, 8) == 1.0  # k = n: any correct sample passes
    assert ev.pass_at_k(8, 5, 4) == 1.0  # fewer than k wrong samples


def test_pass_at_k_matches_exact_binomials():
    for n, c, k in [(5, 2, 3), (16, 3, 8), (30, 7, 1), (64, 1, 10), (1000, 10, 500), (1024, 3, 512)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert ev.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9)


@pytest.mark.parametrize(
    "n, c, k, word",
    [
        (8, 2, 9, "k=9"),
        (8, 2, 0, "k=0"),
        (8, 9, 1, "c=9"),
        (8, -1, 1, "c=-1"),
        (0, 0, 1, "n=0"),
        (8.0, 2, 4, "n must be an integer"),
        (8, True, 4, "c must be an integer"),
    ],
)
def test_pass_at_k_bad_input(n, c, k, word):
    with pytest.raises(ValueError, match=word):
        ev.pass_at_k(n, c, k)


def test_mean_at_k():
    correct = [[1, 0, 1, 1], [0, 0, 0, 1], [True, True, False, False]]
    assert ev.mean_at_k(correct) == pytest.approx(6 / 12)
    assert ev.mean_at_k(np.ones((3, 2), dtype=bool)) == 1.0
    for bad in ([1, 0, 1], [[1, 2]], np.zeros((0, 4))):
        with pytest.raises(ValueError, match="correct"):
            ev.mean_at_k(bad)


def test_majority_vote_ties_and_missing_answers():
    assert ev.majority_index(["3", "5", "5", "3"]) == 0  # 2-2 tie: the answer seen first wins
    assert ev.majority_index(["5", "3", "3", "5"]) == 0
    assert ev.majority_index(["1", "2", "2"]) == 1  # a strict majority beats an earlier answer
    assert ev.majority_index([None, None, None, "7"]) == 3  # a missing answer never wins, however frequent
    assert ev.majority_index([None, None]) is None
    assert ev.majority_index([" 7", "8", "7 "]) == 0  # surrounding spaces do not split a vote
    assert ev.majority_index(["x", "y", "z"]) == 0  # all different: the first


def test_maj_at_k():
    answers = [
        ["3", "5", "5", "3"],  # tie won by the wrong "3"
        ["5", "3", "3", "5"],  # tie won by the right "5"
        [None, None, None, "7"],  # the lone answer is right
        [None, None, None, None],
    ]  # no answer: wrong
    correct = [[0, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert ev.maj_at_k(answers, correct) == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="same"):
        ev.maj_at_k([["1", "2"]], [[1, 0, 0]])
    with pytest.raises(ValueError, match="same"):
        ev.maj_at_k([["1"], ["2"]], [[1]])


# -----------------------------------------------------------------------------
# error bars


def test_standard_error_matches_direct_formula():
    values = np.random.default_rng(1).random(37)
    mean = sum(values) / len(values)
    direct = math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1)) / math.sqrt(len(values))
    assert ev.standard_error(values) == pytest.approx(direct, rel=1e-12)
    assert ev.standard_error([0.0, 1.0]) == pytest.approx(0.5)  # std sqrt(1/2), over sqrt(2)
    assert math.isnan(ev.standard_error([0.3]))
    with pytest.raises(ValueError, match="values"):
        ev.standard_error([])


def test_bootstrap_interval_is_seeded_and_matches_normal_width():
    values = np.random.default_rng(2).integers(0, 2, size=400).astype(float)
    lo, hi = ev.bootstrap_interval(values, seed=3)
    assert lo < values.mean() < hi
    assert (lo, hi) == ev.bootstrap_interval(values, seed=3)
    assert (lo, hi) != ev.bootstrap_interval(values, seed=4)
    # with 400 problems the mean is nearly normal: the 95% interval is about mean +- 1.96 se
    se = ev.standard_error(values)
    assert hi - lo == pytest.approx(2 * 1.96 * se, rel=0.1)
    lo80, hi80 = ev.bootstrap_interval(values, seed=3, level=0.8)
    assert lo < lo80 < hi80 < hi
    with pytest.raises(ValueError, match="level"):
        ev.bootstrap_interval(values, level=1.0)


def test_summarize_per_problem_metrics():
    problems = [
        problem(
            "a",
            [1, 1, 0, 0],
            answers=["4", "4", "5", "5"],
            lengths=[10, 20, 30, 40],
            truncated=[False, False, False, True],
        ),
        problem("b", [0, 0, 0, 1], answers=["1", "1", "2", "3"], lengths=[5, 5, 5, 5]),
        problem("c", [0, 0, 0, 0], answers=[None] * 4, lengths=[100, 100, 100, 100], truncated=[True] * 4),
    ]
    summary = ev.summarize(problems, k=2)
    accuracy = np.array([0.5, 0.25, 0.0])
    assert summary["mean@k"].mean == pytest.approx(accuracy.mean())
    assert summary["mean@k"].se == pytest.approx(accuracy.std(ddof=1) / math.sqrt(3))
    # pass@2 with 4 samples: 1 - C(2,2)/C(4,2) = 5/6, 1 - C(3,2)/C(4,2) = 1/2, 0
    assert summary["pass@k"].mean == pytest.approx((5 / 6 + 1 / 2 + 0) / 3)
    # maj@2 votes over the first two samples: "4" (right), "1" (wrong), none
    assert summary["maj@k"].mean == pytest.approx(1 / 3)
    assert summary["length"].mean == pytest.approx((25 + 5 + 100) / 3)
    assert summary["truncated"].mean == pytest.approx((0.25 + 0 + 1) / 3)
    for estimate in summary.values():
        assert estimate.lo <= estimate.mean <= estimate.hi
    with pytest.raises(ValueError, match="k=5 must be between 1 and the 4 samples drawn"):
        ev.summarize(problems, k=5)


def test_average_over_benchmarks():
    run = {
        "x": evaluation({"1": [1, 1], "2": [0, 1], "3": [0, 0]}, k=2),
        "y": evaluation({"1": [1, 0], "2": [1, 1]}, k=2),
    }
    avg = ev.average(run)
    x, y = run["x"].summary["mean@k"], run["y"].summary["mean@k"]
    assert avg["mean@k"].mean == pytest.approx((0.5 + 0.75) / 2)
    assert avg["mean@k"].se == pytest.approx(math.sqrt(x.se**2 + y.se**2) / 2)
    assert avg["mean@k"].lo <= avg["mean@k"].mean <= avg["mean@k"].hi
    assert avg == ev.average(run)


# -----------------------------------------------------------------------------
# comparisons


def test_compare_paired_z():
    run_a = {"bench": evaluation({"p1": [1, 0], "p2": [0, 0], "p3": [1, 1], "p4": [0, 1]}, k=2)}
    # B listed in another order: pairing is by id, not position
    run_b = {"bench": evaluation({"p4": [0, 1], "p3": [1, 1], "p2": [0, 1], "p1": [1, 1]}, k=2)}
    gap = ev.compare(run_a, run_b)["bench"]["mean@k"]
    # per-problem differences 0.5, 0.5, 0, 0: mean 1/4, sample std sqrt(1/12), se sqrt(1/12)/2, z = sqrt(3)
    assert gap.a == pytest.approx(0.5) and gap.b == pytest.approx(0.75)
    assert gap.diff == pytest.approx(0.25)
    assert gap.se == pytest.approx(math.sqrt(1 / 12) / 2)
    assert gap.z == pytest.approx(math.sqrt(3))
    assert gap.noise
    # pass@2 per problem: A 1,0,1,1 and B 1,1,1,1 -> differences 0,1,0,0: z = 0.25 / 0.25 = 1
    assert ev.compare(run_a, run_b)["bench"]["pass@k"].z == pytest.approx(1.0)
    same = ev.compare(run_a, run_a)["bench"]["mean@k"]
    assert (same.diff, same.z, same.noise) == (0.0, 0.0, True)


def test_compare_flags_real_gaps_and_averages():
    rows_a = {str(i): [0, 0] for i in range(20)}
    rows_b = {str(i): [1, 1] if i < 15 else [0, 1] for i in range(20)}
    run_a = {"x": evaluation(rows_a, k=2), "y": evaluation(rows_a, k=2)}
    run_b = {"x": evaluation(rows_b, k=2), "y": evaluation(rows_a, k=2)}
    gaps = ev.compare(run_a, run_b)
    assert not gaps["x"]["mean@k"].noise and gaps["x"]["mean@k"].z > 2
    assert gaps["y"]["mean@k"].noise
    avg = gaps["average"]["mean@k"]
    assert avg.diff == pytest.approx((gaps["x"]["mean@k"].diff + 0) / 2)
    assert avg.se == pytest.approx(gaps["x"]["mean@k"].se / 2)
    # every problem the same gap: zero spread, so the gap is exact
    exact = ev.compare({"x": evaluation(rows_a, k=2)}, {"x": evaluation({i: [1, 1] for i in rows_a}, k=2)})
    assert exact["x"]["mean@k"].z == math.inf and not exact["x"]["mean@k"].noise


def test_compare_bad_input():
    run = {"x": evaluation({"1": [1, 0], "2": [0, 0]}, k=2)}
    with pytest.raises(ValueError, match=r"only in A: \['2'\]"):
        ev.compare(run, {"x": evaluation({"1": [1, 0], "3": [0, 0]}, k=2)})
    with pytest.raises(ValueError, match="different k"):
        ev.compare(run, {"x": evaluation({"1": [1, 0], "2": [0, 0]}, k=1)})
    with pytest.raises(ValueError, match="share no benchmark"):
        ev.compare(run, {"z": run["x"]})
    with pytest.raises(ValueError, match="duplicate"):
        ev.compare(run, {"x": ev.Evaluation(2, [problem("1", [1, 0]), problem("1", [1, 0])], {})})


def test_compare_to_baseline():
    run = {"x": evaluation({str(i): [1, 0] if i % 2 else [1, 1] for i in range(10)}, k=2)}
    ours = run["x"].summary["mean@k"]  # mean 0.75
    baseline = {"x": {"mean@k": {"mean": 0.5, "se": 0.1}, "pass@k": {"mean": 0.9}}, "other": {"mean@k": {"mean": 0}}}
    gaps = ev.compare_to_baseline(run, baseline)
    gap = gaps["x"]["mean@k"]
    assert (gap.a, gap.b, gap.diff) == pytest.approx((0.5, 0.75, 0.25))
    assert gap.se == pytest.approx(math.sqrt(ours.se**2 + 0.1**2))
    assert gap.z == pytest.approx(0.25 / gap.se)
    assert gaps["x"]["pass@k"].se == pytest.approx(run["x"].summary["pass@k"].se)  # no se: the baseline is exact
    assert set(gaps) == {"x", "average"}
    with pytest.raises(ValueError, match="unknown metric 'acc'"):
        ev.compare_to_baseline(run, {"x": {"acc": {"mean": 0.5}}})
    with pytest.raises(ValueError, match="shares no benchmark"):
        ev.compare_to_baseline(run, {"y": {"mean@k": {"mean": 0.5}}})


# -----------------------------------------------------------------------------
# run files and tables


def test_run_file_round_trip_and_tables(tmp_path):
    run = {"x": evaluation({"1": [1, 0], "2": [0, 0], "3": [1, 1]}, k=2)}
    path = tmp_path / "sub" / "run.json"
    ev.save_run(str(path), {"k": 2}, run, ev.average(run))
    assert ev.load_run(str(path)) == run
    assert json.loads(path.read_text())["config"] == {"k": 2}
    table = ev.summary_table(run, ev.average(run))
    assert "| x | 3 | 50.0 ± " in table and "mean@2 (%)" in table and "| average | 3 |" in table
    table = ev.comparison_table(ev.compare(run, run), "A", "B", k=2)
    assert "| x | pass@2 | 66.7 | 66.7 |" in table and "noise" in table


def test_load_run_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        ev.load_run(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"benchmarks": {"x": {"k": 2}}}')
    with pytest.raises(ValueError, match="bad.json"):
        ev.load_run(str(bad))


# -----------------------------------------------------------------------------
# end to end: a tiny random model on a 3-problem jsonl


def write_jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def eval_args(model_dir, bench, out, *extra: str) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--bench",
        str(bench),
        "--k",
        "2",
        "--n",
        "3",
        "--temperature",
        "1.0",
        "--top-p",
        "1.0",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        "--out",
        str(out),
        *extra,
    ]


def test_end_to_end_eval(tiny_model_dir, tmp_path, capsys):
    import reward

    questions = ["What is 7 + 5?", "What is 2 + 2?", "Answer: 42"]
    bench = write_jsonl(
        tmp_path / "tiny3.jsonl", [{"id": f"q{i}", "problem": q, "answer": "12"} for i, q in enumerate(questions)]
    )
    ev.main(eval_args(tiny_model_dir, bench, tmp_path / "first.json"))
    first = ev.load_run(str(tmp_path / "first.json"))["tiny3"]
    # Same seed, same samples: make each problem's first completion the right answer, so the run has both
    # correct and wrong samples and a misaligned row (prompt-major slicing) would show
    rows = [
        {"id": p.id, "problem": q, "answer": reward.extract_answer(p.completions[0])}
        for p, q in zip(first.problems, questions)
    ]
    assert all(row["answer"] for row in rows)
    write_jsonl(bench, rows)
    capsys.readouterr()
    ev.main(eval_args(tiny_model_dir, bench, tmp_path / "second.json"))
    stdout = capsys.readouterr().out

    saved = json.loads((tmp_path / "second.json").read_text())
    assert saved["config"]["k"] == 2 and saved["config"]["n"] == 3 and saved["config"]["temperature"] == 1.0
    run = ev.load_run(str(tmp_path / "second.json"))["tiny3"]
    assert [p.id for p in run.problems] == ["q0", "q1", "q2"]
    for p, before in zip(run.problems, first.problems):
        assert p.completions == before.completions
        assert len(p.completions) == len(p.answers) == len(p.lengths) == len(p.truncated) == 3
        assert p.correct == [reward.grade(text, p.reference) for text in p.completions]
        assert p.correct[0]
        assert all(1 <= length <= 6 for length in p.lengths)
        assert all(length == 6 for length, cut in zip(p.lengths, p.truncated) if cut)
    counts = [sum(p.correct) for p in run.problems]
    assert run.summary["mean@k"].mean == pytest.approx(sum(counts) / 9)
    # pass@2 from 3 samples with c correct: 1 - C(3-c, 2) / C(3, 2)
    assert run.summary["pass@k"].mean == pytest.approx(np.mean([1 - math.comb(3 - c, 2) / 3 for c in counts]))
    assert run.summary["length"].mean == pytest.approx(np.mean([np.mean(p.lengths) for p in run.problems]))
    assert "| tiny3 | 3 | " in stdout and "| average | 3 | " in stdout and "second.json" in stdout

    # the first run graded everything against "12": the paired comparison sees the references change
    baseline = write_jsonl(tmp_path / "baseline.json", [])
    baseline.write_text(json.dumps({"tiny3": {"mean@k": {"mean": 0.0, "se": 0.0}}}))
    ev.main(["--compare", str(tmp_path / "first.json"), str(tmp_path / "second.json"), "--baseline", str(baseline)])
    stdout = capsys.readouterr().out
    gap = ev.compare({"tiny3": first}, {"tiny3": run})["tiny3"]["mean@k"]
    assert gap.diff == pytest.approx(run.summary["mean@k"].mean - first.summary["mean@k"].mean)
    assert "| tiny3 | mean@2 |" in stdout and "| tiny3 | pass@2 |" in stdout and "against the baseline" in stdout


def test_evaluate_with_adapter_restores_train_mode(tiny_model_dir, tmp_path):
    import torch

    import lora
    from infra.weights import from_pretrained, load_tokenizer

    model, tokenizer = from_pretrained(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    problems = [{"problem": "What is 2 + 2?", "answer": "4"}]
    kwargs = dict(k=1, temperature=0.0, max_new_tokens=6, progress=False)
    base = ev.evaluate(model, tokenizer, problems, **kwargs)
    lora.inject(model, rank=2, alpha=4)
    torch.manual_seed(0)
    for module in lora.lora_modules(model).values():
        torch.nn.init.normal_(module.lora_B.weight, std=1.0)
    lora.save(model, tmp_path / "adapter")
    model.train()
    adapted = ev.evaluate(model, tokenizer, problems, **kwargs)
    assert model.training
    assert adapted.problems[0].id == "0"  # no "id" field: named by position
    assert adapted.problems[0].completions != base.problems[0].completions

    bench = write_jsonl(tmp_path / "one.jsonl", problems)
    out = tmp_path / "run.json"
    ev.main(
        [
            "--model",
            str(tiny_model_dir),
            "--adapter",
            str(tmp_path / "adapter"),
            "--bench",
            str(bench),
            "--k",
            "1",
            "--temperature",
            "0",
            "--max-new-tokens",
            "6",
            "--out",
            str(out),
        ]
    )
    assert ev.load_run(str(out))["one"].problems[0].completions == adapted.problems[0].completions


def user_error(argv: list[str], capsys) -> str:
    """ev.main on a command that is a user error: exit status 2 and one line on stderr, no traceback; returns it."""
    with pytest.raises(SystemExit) as exit_info:
        ev.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def no_model(monkeypatch):
    """Makes loading a model fail the test: user errors must be found before it."""

    def load(*args, **kwargs):
        pytest.fail("a model was loaded before the input was checked")

    monkeypatch.setattr(ev, "from_pretrained", load)


def test_cli_bad_input(tmp_path, capsys, no_model):
    bench = write_jsonl(tmp_path / "one.jsonl", [{"problem": "What is 2 + 2?", "answer": "4"}])
    out = ["--bench", str(bench), "--out", str(tmp_path / "run.json")]
    err = user_error(["--adapter", str(tmp_path / "nowhere"), *out], capsys)
    assert "eval.py: --adapter: directory" in err and "nowhere does not exist" in err
    assert "unknown dataset 'aime99'; known: " in user_error(["--bench", "aime99"], capsys)
    assert "--k 8 is larger than the --n 4 samples drawn" in user_error(["--k", "8", "--n", "4"], capsys)
    for flags, message in [
        (["--limit", "0"], "--limit 0: must be >= 1"),
        (["--limit-seed", "3"], "--limit-seed needs --limit N"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (["--temperature", "nan"], "--temperature nan: must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
        (["--template", "nope"], "--template: template must be one of answer, boxed"),
        (["--device", "gpu"], "--device gpu: Expected one of cpu, cuda"),
    ]:
        assert message in user_error([*out, *flags], capsys)
    with pytest.raises(ValueError, match="k=3 must be between 1 and the number of samples drawn per problem n=2"):
        ev.evaluate(None, None, [{"problem": "1 + 1", "answer": "2"}], k=3, n=2, temperature=1.0, max_new_tokens=4)
    assert "nothing.json does not exist" in user_error(["--compare", *[str(tmp_path / "nothing.json")] * 2], capsys)
    assert not (tmp_path / "run.json").exists()


def test_out_is_checked_before_the_model_loads(tmp_path, capsys, no_model):
    bench = write_jsonl(tmp_path / "one.jsonl", [{"problem": "What is 2 + 2?", "answer": "4"}])
    err = user_error(["--bench", str(bench), "--out", str(tmp_path)], capsys)
    assert f"--out {tmp_path}: is a directory" in err
    blocker = tmp_path / "file.txt"
    blocker.write_text("mine")
    err = user_error(["--bench", str(bench), "--out", str(blocker / "sub" / "run.json")], capsys)
    assert f"--out {blocker / 'sub' / 'run.json'}: cannot write there" in err
    assert blocker.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "one.jsonl"]


def test_limit_takes_the_first_problems_or_a_seeded_sample():
    problems = [{"problem": f"p{i}", "answer": "1"} for i in range(10)] + [{"id": "x", "problem": "p10", "answer": "2"}]
    assert [p["id"] for p in ev.limit_problems(problems, 3)] == [0, 1, 2]
    sample = ev.limit_problems(problems, 4, seed=5)
    assert sample == ev.limit_problems(problems, 4, seed=5) != ev.limit_problems(problems, 4, seed=6)
    positions = [int(p["problem"][1:]) for p in sample]
    assert len(set(positions)) == 4 and positions == sorted(positions)  # benchmark order kept
    assert [p["id"] for p in sample] == ["x" if i == 10 else i for i in positions]  # ids of the full benchmark
    assert [p["id"] for p in ev.limit_problems(problems, 50)] == [*range(10), "x"]
    assert ev.limit_problems(problems, None)[3] == {"id": 3, "problem": "p3", "answer": "1"}


def test_limit_and_strict_json_end_to_end(tiny_model_dir, tmp_path):
    bench = write_jsonl(
        tmp_path / "tiny3.jsonl", [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)]
    )
    out = tmp_path / "run.json"
    ev.main(eval_args(tiny_model_dir, bench, out, "--limit", "1", "--limit-seed", "4"))
    text = out.read_text()

    def reject(constant):
        raise AssertionError(f"{constant} in a JSON file")

    saved = json.loads(text, parse_constant=reject)  # strict: NaN and Infinity are not JSON
    problems = saved["benchmarks"]["tiny3"]["problems"]
    expected = ev.limit_problems(ev.load_problems(str(bench)), 1, seed=4)[0]
    assert [p["id"] for p in problems] == [str(expected["id"])] and problems[0]["reference"] == expected["answer"]
    assert saved["benchmarks"]["tiny3"]["summary"]["mean@k"]["se"] is None  # one problem: no spread to measure
    assert saved["average"]["mean@k"]["se"] is None and saved["config"]["limit"] == 1
    assert math.isnan(ev.load_run(out)["tiny3"].summary["mean@k"].se)


def test_late_failure_keeps_the_finished_problems(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import reward

    bench = write_jsonl(tmp_path / "tiny3.jsonl", [{"problem": f"What is {i} + 1?", "answer": "2"} for i in range(3)])
    grade, calls = reward.reward, []

    def fail_on_second_batch(error):
        def grade_or_fail(*args, **kwargs):
            calls.append(1)
            if len(calls) % 2 == 0:
                raise error
            return grade(*args, **kwargs)

        return grade_or_fail

    out = tmp_path / "run.json"
    monkeypatch.setattr(reward, "reward", fail_on_second_batch(RuntimeError("grader crashed")))
    with pytest.raises(RuntimeError, match="grader crashed"):  # an internal error keeps its traceback
        ev.main(eval_args(tiny_model_dir, bench, out))
    partial = tmp_path / "run.partial.json"
    assert f"the 2 problems finished are in {partial}" in capsys.readouterr().err and not out.exists()
    kept = ev.load_run(partial)["tiny3"]
    assert [p.id for p in kept.problems] == ["0", "1"] and json.loads(partial.read_text())["config"]["partial"]

    partial.unlink()
    monkeypatch.setattr(reward, "reward", fail_on_second_batch(KeyboardInterrupt()))
    with pytest.raises(SystemExit) as exit_info:
        ev.main(eval_args(tiny_model_dir, bench, out))
    assert exit_info.value.code == 130
    assert f"interrupted; the 2 problems finished are in {partial}" in capsys.readouterr().err
    assert [p.id for p in ev.load_run(partial)["tiny3"].problems] == ["0", "1"]


def test_failing_to_write_out_keeps_the_results_beside_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    bench = write_jsonl(tmp_path / "tiny3.jsonl", [{"problem": "What is 1 + 1?", "answer": "2"}] * 3)
    out, save = tmp_path / "run.json", ev.save_run

    def save_but_not_out(path, *args):
        if Path(path) == out:
            raise PermissionError(13, "Permission denied")
        save(path, *args)

    monkeypatch.setattr(ev, "save_run", save_but_not_out)
    with pytest.raises(SystemExit) as exit_info:
        ev.main(eval_args(tiny_model_dir, bench, out))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "| tiny3 | 3 |" in captured.out  # the table is printed before the file is written
    partial = tmp_path / "run.partial.json"
    assert f"--out {out}: cannot write (Permission denied); the 3 problems finished are in {partial}" in captured.err
    assert len(ev.load_run(partial)["tiny3"].problems) == 3


def test_the_batch_size_bounds_memory_and_changes_no_sample(tiny_model_dir):
    from infra.weights import from_pretrained, load_tokenizer

    model, tokenizer = from_pretrained(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    problems = [{"problem": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(5)]
    kwargs = dict(k=3, temperature=1.0, max_new_tokens=6, progress=False, seed=7)
    whole, split = (ev.evaluate(model, tokenizer, problems, batch_size=size, **kwargs) for size in (5, 2))
    assert [p.completions for p in split.problems] == [p.completions for p in whole.problems]
    assert len({c for p in whole.problems for c in p.completions}) > 1, "sampling, not one repeated answer"


def test_code_benchmarks_report_pass_and_mean_at_k(tiny_model_dir, monkeypatch):
    """On a code set each sample is graded by running its program; Pass@k and Mean@k follow from those flags."""
    import types

    import torch

    from grading import sandbox
    from infra.weights import from_pretrained, load_tokenizer

    tests = {
        "task": "code",
        "style": "stdio",
        "tests": [{"input": "2\n", "output": "4"}, {"input": "5\n", "output": "10"}],
    }
    problems = [{"id": "a", "problem": "Double n.", **tests}, {"id": "b", "problem": "Also double n.", **tests}]
    right, wrong = "```python\nprint(2 * int(input()))\n```", "```python\nprint(int(input()) + 2)\n```"
    texts = [right, wrong, "no code", wrong, wrong, wrong]  # problem a: 1 of 3 right, problem b: none

    def generate(model, prompts, samples_per_prompt, **_):
        rows = len(prompts) * samples_per_prompt
        return types.SimpleNamespace(
            texts=texts[:rows],
            completion_mask=torch.ones(rows, 4, dtype=torch.bool),
            truncated=torch.zeros(rows, dtype=torch.bool),
        )

    monkeypatch.setattr(ev.rollout, "generate", generate)
    model, tokenizer = from_pretrained(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    try:
        run = ev.evaluate(
            model,
            tokenizer,
            problems,
            k=2,
            n=3,
            temperature=1.0,
            max_new_tokens=4,
            template="code",
            batch_size=2,
            progress=False,
        )
    except sandbox.SandboxUnavailable as error:
        pytest.skip(str(error))
    assert [p.correct for p in run.problems] == [[True, False, False], [False, False, False]]
    assert run.problems[0].reference == "2 stdio tests" and run.problems[0].answers[2] is None
    assert run.problems[0].answers[0] == "print(2 * int(input()))"
    assert run.summary["mean@k"].mean == pytest.approx(1 / 6)
    assert run.summary["pass@k"].mean == pytest.approx((1 - 1 / 3) / 2)  # a: 1 - C(2, 2) / C(3, 2)


def test_a_damaged_or_foreign_adapter_and_a_binary_run_file_are_one_line_errors(tiny_model_dir, tmp_path, capsys):
    import lora
    from conftest import make_tiny_checkpoint
    from infra.weights import from_pretrained

    bench = write_jsonl(tmp_path / "one.jsonl", [{"problem": "What is 2 + 2?", "answer": "4"}])
    args = ["--model", str(tiny_model_dir), "--bench", str(bench), "--out", str(tmp_path / "run.json")]
    truncated = tmp_path / "truncated"
    lora.save(lora.inject(from_pretrained(str(tiny_model_dir)), rank=2, alpha=4), truncated)
    weights_file = truncated / lora.WEIGHTS_FILE
    weights_file.write_bytes(weights_file.read_bytes()[:100])
    assert "not a readable safetensors file" in user_error([*args, "--adapter", str(truncated)], capsys)
    foreign = tmp_path / "foreign"  # an adapter of a wider model
    wide = from_pretrained(str(make_tiny_checkpoint(tmp_path / "wide", hidden_size=64)))
    lora.save(lora.inject(wide, rank=2, alpha=4), foreign)
    capsys.readouterr()  # transformers' own progress lines while saving the wide model
    err = user_error([*args, "--adapter", str(foreign)], capsys)
    assert "has shape" in err and "an adapter of another model?" in err
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\x00\xff\xfe")
    assert f"{binary}: not a run file" in user_error(["--compare", str(binary), str(binary)], capsys)


def fake_run(path: Path, **settings) -> Path:
    """A run directory as train.py leaves it, without weights: config.json, its last checkpoint's adapter, a best
    adapter, a summary."""
    saved = {
        "model": "some/model",
        "template": "equation",
        "system_prompt": "Be brief.",
        "eval_temperature": 1.0,
        "top_p": 0.9,
        "max_new_tokens": 16,
        "eval_k": 8,
        "eval_dataset": "arithmetic_test",
        "eval_problems": 0,
        "seed": 3,
        "dtype": "auto",
        **settings,
    }
    (path / "best").mkdir(parents=True)
    (path / "best" / "adapter_config.json").write_text("{}")
    (path / "checkpoint-000020" / "adapter").mkdir(parents=True)
    (path / "checkpoint-000020" / "adapter" / "adapter_config.json").write_text("{}")
    (path / "latest").write_text("checkpoint-000020")
    (path / "config.json").write_text(json.dumps(saved))
    (path / "summary.json").write_text(json.dumps({"best": {"accuracy": 0.625, "step": 20}}))
    return path


def test_run_settings_fill_the_flags_not_given_and_name_the_best_adapter(tmp_path):
    run = fake_run(tmp_path / "runs" / "demo")
    args = ev.parse_args(["--run", str(run), "--k", "4", "--temperature", "0.6"])
    assert (args.model, args.template, args.system, args.top_p, args.max_new_tokens, args.bench, args.seed) == (
        "some/model",
        "equation",
        "Be brief.",
        0.9,
        16,
        "arithmetic_test",
        3,
    )
    assert (args.k, args.temperature, args.limit, args.dtype) == (4, 0.6, None, None), "flags win; auto stays auto"
    assert args.adapter == str(run) and "k" not in args.from_run and "top_p" in args.from_run
    # the default is the run's last adapter; --checkpoint best takes the one chosen on its validation split
    assert args.checkpoint == "last"
    assert ev.resolve_adapter(args.adapter) == (
        run / "checkpoint-000020" / "adapter",
        "the run's last adapter (checkpoint-000020)",
    )
    assert ev.resolve_adapter(args.adapter, "best") == (
        run / "best",
        "the run's best on its validation split: accuracy 62.5% at step 20",
    )
    line = ev.settings_line(args, run / "best", "the run's best")
    assert "--template equation --system 'Be brief.' --seed 3" in line and "--k 4 --temperature 0.6" in line
    (run / "best" / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="--checkpoint best: the run has no best adapter yet"):
        ev.resolve_adapter(str(run), "best")
    assert ev.parse_args(["--run", str(run), "--system", ""]).system is None, "empty: the chat template's own"


def test_no_held_out_figure_comes_from_a_checkpoint_chosen_on_its_problems(tiny_model_dir, tmp_path, varied_rewards):
    """The best checkpoint is chosen on a validation split of the training set that holds no held-out problem
    and is never trained on; the held-out figures (before, every --eval-every, after) are the policy's at
    their step, after is the last's, and eval.py --run evaluates the last adapter unless told otherwise."""
    from conftest import metric_lines, run_training, tiny_args
    from data import load_problems
    from infra import rundir

    argv = tiny_args(tiny_model_dir, tmp_path, "run", "--steps", "4", "--eval-every", "2", "--dataset", "two_digit")
    argv += ["--eval-dataset", "two_digit_test"]
    state = run_training(argv)
    run = tmp_path / "run"
    validation = json.loads((run / "validation.json").read_text())
    held_out = {p["problem"] for p in load_problems("two_digit_test")}
    assert validation["drawn_from"] == "two_digit" and len(validation["problems"]) == 32
    assert not set(validation["problems"]) & held_out, "the validation split holds no held-out problem"
    train_set, split = rundir.validation_split(load_problems("two_digit"), {"t": load_problems("two_digit_test")}, 0)
    assert [p["problem"] for p in split] == validation["problems"]
    assert not {p["problem"] for p in train_set} & set(validation["problems"]), "and is never trained on"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best"]["split"] == "validation" and summary["best"]["problems"] == 32
    step_2 = [line["validation"] for line in metric_lines(run) if line.get("validation")]
    assert len(step_2) == 1 and step_2[0]["problems"] == 32 and summary["best"]["step"] in (2, 4)
    # the held-out evaluations are on the held-out set, at their own steps; none is picked by the best
    assert summary["after"]["problems"] == 3 and state["step"] == 4
    args = ev.parse_args(["--run", str(run)])
    adapter, what = ev.resolve_adapter(args.adapter, args.checkpoint)
    assert adapter == run / "checkpoint-000004" / "adapter" and what == "the run's last adapter (checkpoint-000004)"


def test_run_and_out_mistakes_fail_before_the_model_loads(tmp_path, capsys, no_model):
    err = user_error(["--run", str(tmp_path)], capsys)
    assert f"--run {tmp_path}: not a run directory of train.py or sft.py (no config.json)" in err
    (tmp_path / "empty").mkdir()
    assert "neither an adapter (no adapter_config.json) nor a run directory" in user_error(
        ["--adapter", str(tmp_path / "empty")], capsys
    )
    run = fake_run(tmp_path / "demo")
    (run / "eval.json").write_text("mine")
    err = user_error(["--run", str(run), "--out", str(run / "eval.json")], capsys)
    assert "already exists; pass --force to overwrite it" in err and (run / "eval.json").read_text() == "mine"


def test_an_sft_run_is_evaluated_with_its_own_settings_and_adapter(tmp_path):
    import config

    run = tmp_path / "runs" / "sft"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    settings = config.SFTConfig(template="answer", eval_problems=64, eval_k=2, max_new_tokens=32, eval_temperature=0.8)
    (run / "config.json").write_text(json.dumps(config.flat_config(settings)))
    args = ev.parse_args(["--run", str(run)])
    assert (args.template, args.k, args.limit, args.max_new_tokens, args.temperature, args.bench) == (
        "answer",
        2,
        64,
        32,
        0.8,
        "arithmetic_test",
    )
    assert args.top_p == 1.0 and "top_p" in args.from_run, "sft.py samples its held-out sets without nucleus"
    assert ev.resolve_adapter(args.adapter) == (run / "adapter", "the supervised run's adapter")
    (run / "config.json").write_text(json.dumps(config.flat_config(config.SFTConfig(eval_dataset=""))))
    assert ev.parse_args(["--run", str(run)]).bench == ev.DEFAULTS["bench"], "a run with no held-out set of its own"
