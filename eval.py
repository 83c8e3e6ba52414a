"""
Evaluation: Mean@k, Pass@k and Maj@k on math and code benchmarks, with error bars, and run-versus-run comparisons.

Published RLVR results report Mean@k and Pass@k on AIME/AMC without error bars, although AIME has only 30
problems: one problem is 3.3 points. This file measures a model the same way and says how sure the numbers are:
every metric comes with its standard error over problems and a seeded bootstrap interval, and --compare pairs two
runs problem by problem so a reader sees at once which gaps are noise.

    python eval.py --model PATH_OR_ID [--adapter DIR] --bench aime24,aime25,amc23 --k 8 --temperature 0.6 \
        --top-p 0.95 --max-new-tokens 4096 [--out runs/eval.json]
    python eval.py --run runs/NAME [--bench aime24 --k 16 ...]   # as the run trained: its settings, last adapter
    python eval.py --compare A.json B.json [--baseline TABLE.json]
    python eval.py --bench math500 --limit 20 --limit-seed 0 --k 2 --max-new-tokens 1024    # a quick try

Every file written is strict JSON (an undefined standard error is null); an existing --out is kept unless --force.
If sampling fails or is interrupted, the problems finished so far are written beside --out as OUT.partial.json.
--run takes a training run's model, prompt (template, system prompt, thinking setting where the run has one),
sampling, held-out sets and k, and its last adapter (--checkpoint best: the one best on its validation split,
never chosen on the held-out sets), prints the equivalent command, and lets flags override.

The statistics are plain numpy over a [problems, samples] table of correct flags. evaluate() is the plain function
train.py's held-out evaluation (held_out: each rank a slice of each set, over the run's KV pool) calls before,
during and after training, so a run and this command measure the same way.
"""

import argparse
import inspect
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import lora
import reward
import rollout
from config import Config
from data import load_problems, opens_thought, render_prompt, stop_ids, thinking_note, user_message
from engine.pool import sampling_policy
from grading import sandbox, scoring
from infra import distributed
from infra.errors import oom_hint
from infra.rundir import strict_json
from infra.weights import from_pretrained, load_tokenizer

# -----------------------------------------------------------------------------
# statistics over a [problems, samples] table


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    As floats the binomials overflow beyond about a thousand samples (C(2048, 1024) is near 1e615), so use the
    product form C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i), every factor in [0, 1].
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"pass_at_k: {name} must be an integer, got {value!r}")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be between 1 and the number of samples n={n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _correct_table(correct) -> np.ndarray:
    """Checks and converts correct flags to a float array [P, n]."""
    table = np.asarray(correct, dtype=float)
    if table.ndim != 2 or table.size == 0:
        raise ValueError(f"correct must be a non-empty [problems, samples] table, got shape {table.shape}")
    if not np.isin(table, (0.0, 1.0)).all():
        raise ValueError("correct must hold only booleans or 0/1")
    return table


def mean_at_k(correct) -> float:
    """Mean@k: the accuracy of a single sample averaged over the k samples and the problems; correct is [P, k]."""
    return float(_correct_table(correct).mean())


def majority_index(answers: Sequence[str | None]) -> int | None:
    """Index of the sample whose answer wins the vote, or None when no sample has an answer.

    Answers vote by exact string (after stripping spaces); None (nothing extracted) never wins. A tie goes to the
    answer that appeared first among the samples, so the vote is deterministic and favours no answer by content.
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        key = answer.strip()
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    winner = max(counts, key=lambda key: (counts[key], -first[key]))
    return first[winner]


def _maj_scores(answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[float]]) -> np.ndarray:
    """Per problem, 1.0 when the majority answer is correct; [P]."""
    if len(answers) != len(correct) or any(len(a) != len(c) for a, c in zip(answers, correct)):
        raise ValueError(
            f"answers and correct must have the same [problems, samples] shape, got "
            f"{[len(a) for a in answers]} answers against {[len(c) for c in correct]} correct flags"
        )
    votes = [majority_index(row) for row in answers]
    return np.array([0.0 if vote is None else float(row[vote]) for vote, row in zip(votes, correct)])


def maj_at_k(answers: Sequence[Sequence[str | None]], correct) -> float:
    """Maj@k: fraction of problems whose majority answer over the k samples is correct (see majority_index)."""
    return float(_maj_scores(answers, _correct_table(correct)).mean())


def standard_error(values) -> float:
    """Standard error of the mean over problems: sample std (ddof=1) / sqrt(P); NaN for a single problem."""
    values = np.asarray(values, dtype=float)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"values must be a non-empty 1-D array, got shape {values.shape}")
    if values.size == 1:
        return math.nan
    return float(values.std(ddof=1) / math.sqrt(values.size))


def _bootstrap_means(values: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """Means of `resamples` resamples of the problems drawn with replacement; [resamples]."""
    rows = rng.integers(0, values.size, size=(resamples, values.size))  # [R, P]
    return values[rows].mean(axis=1)


def _percentiles(means: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def bootstrap_interval(values, *, seed: int = 0, resamples: int = 2000, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over problems (resampling problems, not samples)."""
    values = np.asarray(values, dtype=float)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"values must be a non-empty 1-D array, got shape {values.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    return _percentiles(_bootstrap_means(values, np.random.default_rng(seed), resamples), level)


# -----------------------------------------------------------------------------
# per-problem results and their summary

# JSON keys of the metrics; "@k" is shown with the run's k in tables. Rates are fractions, length is in tokens.
METRICS = ("mean@k", "pass@k", "maj@k", "length", "truncated")
LEVEL = 0.95  # bootstrap interval coverage
RESAMPLES = 2000  # bootstrap resamples: the interval's ends move by well under a tenth of a point between seeds


@dataclass
class ProblemResult:
    id: str
    reference: str
    completions: list[str]
    answers: list[str | None]  # extracted answer of each sample, None when nothing was found
    correct: list[bool]
    lengths: list[int]  # completion tokens, stop token included
    truncated: list[bool]  # hit max_new_tokens before a stop token


@dataclass
class Estimate:
    mean: float
    se: float  # standard error over problems
    lo: float  # percentile bootstrap interval at LEVEL
    hi: float


@dataclass
class Evaluation:
    k: int
    problems: list[ProblemResult]
    summary: dict[str, Estimate]


def problem_scores(problems: Sequence[ProblemResult], k: int) -> dict[str, np.ndarray]:
    """Each metric's value on each problem, [P] per metric; the means over problems are the reported numbers.

    With n > k samples, Pass@k uses the unbiased estimator, Mean@k all n samples (same expectation), and Maj@k
    votes over the first k samples (samples are i.i.d., so the first k are a fair draw of k).
    """
    if not problems:
        raise ValueError("problems is empty")
    for p in problems:
        if not 1 <= k <= len(p.correct):
            raise ValueError(f"k={k} must be between 1 and the {len(p.correct)} samples drawn for problem {p.id!r}")
    return {
        "mean@k": np.array([np.mean(p.correct) for p in problems], dtype=float),
        "pass@k": np.array([pass_at_k(len(p.correct), int(sum(p.correct)), k) for p in problems]),
        "maj@k": _maj_scores([p.answers[:k] for p in problems], [p.correct[:k] for p in problems]),
        "length": np.array([np.mean(p.lengths) for p in problems], dtype=float),
        "truncated": np.array([np.mean(p.truncated) for p in problems], dtype=float),
    }


def summarize(problems: Sequence[ProblemResult], k: int, *, seed: int = 0) -> dict[str, Estimate]:
    """Mean, standard error and bootstrap interval of every metric over the problems."""
    summary = {}
    for metric, values in problem_scores(problems, k).items():
        lo, hi = bootstrap_interval(values, seed=seed, resamples=RESAMPLES, level=LEVEL)
        summary[metric] = Estimate(float(values.mean()), standard_error(values), lo, hi)
    return summary


def average(evaluations: Mapping[str, Evaluation], *, seed: int = 0) -> dict[str, Estimate]:
    """The unweighted mean over benchmarks (as the papers' "Avg." column), with its error bars.

    Benchmarks are independent samples, so SE(avg) = sqrt(sum se_b^2) / B, and the bootstrap resamples the problems
    within each benchmark (stratified) before averaging.
    """
    if not evaluations:
        raise ValueError("evaluations is empty")
    scores = [problem_scores(e.problems, e.k) for e in evaluations.values()]
    summary = {}
    for metric in METRICS:
        rng = np.random.default_rng(seed)
        boot = np.mean([_bootstrap_means(s[metric], rng, RESAMPLES) for s in scores], axis=0)  # [R]
        ses = [standard_error(s[metric]) for s in scores]
        mean = float(np.mean([s[metric].mean() for s in scores]))
        summary[metric] = Estimate(mean, math.sqrt(sum(se**2 for se in ses)) / len(scores), *_percentiles(boot, LEVEL))
    return summary


# -----------------------------------------------------------------------------
# comparisons: which gaps are noise


@dataclass
class Gap:
    a: float
    b: float
    diff: float  # b - a
    se: float  # standard error of the difference
    z: float  # diff / se

    @property
    def noise(self) -> bool:
        """Within two standard errors (about a 95% two-sided test); an unknown se (one problem) is noise too."""
        return not abs(self.z) >= 2


def _gap(a: float, b: float, se: float) -> Gap:
    diff = b - a
    if se > 0 or math.isnan(se):
        z = diff / se
    else:  # identical results on every problem: no spread, so any difference is exact
        z = 0.0 if diff == 0 else math.copysign(math.inf, diff)
    return Gap(a, b, diff, se, z)


def _average_gaps(gaps: Mapping[str, Mapping[str, Gap]]) -> dict[str, Gap]:
    """Gaps of the unweighted mean over benchmarks, for the metrics every benchmark has."""
    metrics = [m for m in METRICS if all(m in g for g in gaps.values())]
    return {
        m: _gap(
            float(np.mean([g[m].a for g in gaps.values()])),
            float(np.mean([g[m].b for g in gaps.values()])),
            math.sqrt(sum(g[m].se ** 2 for g in gaps.values())) / len(gaps),
        )
        for m in metrics
    }


def _paired(a: Evaluation, b: Evaluation, name: str) -> tuple[list[ProblemResult], list[ProblemResult]]:
    """The problems of both runs in the same order; a problem missing from one side is an error."""
    by_id = []
    for label, evaluation in (("A", a), ("B", b)):
        ids = {p.id: p for p in evaluation.problems}
        if len(ids) != len(evaluation.problems):
            raise ValueError(f"{name}: run {label} has duplicate problem ids")
        by_id.append(ids)
    only_a, only_b = sorted(by_id[0].keys() - by_id[1].keys()), sorted(by_id[1].keys() - by_id[0].keys())
    if only_a or only_b:
        raise ValueError(
            f"{name}: the runs were not evaluated on the same problems; only in A: {only_a[:5]} "
            f"({len(only_a)}), only in B: {only_b[:5]} ({len(only_b)})"
        )
    order = [p.id for p in a.problems]
    return [by_id[0][i] for i in order], [by_id[1][i] for i in order]


def compare(run_a: Mapping[str, Evaluation], run_b: Mapping[str, Evaluation]) -> dict[str, dict[str, Gap]]:
    """Paired comparison of two runs on the benchmarks both have: benchmark -> metric -> Gap, plus "average".

    Pairing on problems removes the problem-difficulty spread from the difference: SE is the standard error of the
    per-problem differences, much smaller than the two runs' SEs combined when both runs find the same problems hard.
    """
    names = [name for name in run_a if name in run_b]
    if not names:
        raise ValueError(f"the runs share no benchmark: A has {sorted(run_a)}, B has {sorted(run_b)}")
    gaps = {}
    for name in names:
        if run_a[name].k != run_b[name].k:
            raise ValueError(f"{name}: runs use different k (A k={run_a[name].k}, B k={run_b[name].k})")
        problems_a, problems_b = _paired(run_a[name], run_b[name], name)
        scores_a, scores_b = problem_scores(problems_a, run_a[name].k), problem_scores(problems_b, run_b[name].k)
        gaps[name] = {
            m: _gap(float(scores_a[m].mean()), float(scores_b[m].mean()), standard_error(scores_b[m] - scores_a[m]))
            for m in METRICS
        }
    gaps["average"] = _average_gaps(gaps)
    return gaps


def compare_to_baseline(
    run: Mapping[str, Evaluation], baseline: Mapping[str, Mapping[str, Mapping[str, float]]]
) -> dict[str, dict[str, Gap]]:
    """A run against a table of published or earlier numbers: benchmark -> metric -> {"mean": x, "se": s}.

    The table has no per-problem results, so the two are independent: SE = sqrt(se_run^2 + se_baseline^2). A table
    without "se" (papers rarely give one) counts as exact, leaving only the run's own noise. Units as in the run's
    JSON summary: rates as fractions, length in tokens. Gap.a is the baseline, Gap.b the run.
    """
    gaps = {}
    for name in (n for n in run if n in baseline):
        gaps[name] = {}
        for metric, entry in baseline[name].items():
            if metric not in METRICS:
                raise ValueError(f"baseline[{name!r}]: unknown metric {metric!r}; known: {', '.join(METRICS)}")
            if not isinstance(entry, Mapping) or "mean" not in entry:
                raise ValueError(
                    f"baseline[{name!r}][{metric!r}] must be {{'mean': value, 'se': value}}, got {entry!r}"
                )
            ours = run[name].summary[metric]
            gaps[name][metric] = _gap(float(entry["mean"]), ours.mean, math.hypot(ours.se, float(entry.get("se", 0.0))))
    if not gaps:
        raise ValueError(
            f"the baseline shares no benchmark with the run: baseline has {sorted(baseline)}, run has {sorted(run)}"
        )
    gaps["average"] = _average_gaps(gaps)
    return gaps


# -----------------------------------------------------------------------------
# run files and tables


def save_run(
    path: str | Path, config: Mapping, evaluations: Mapping[str, Evaluation], avg: Mapping[str, Estimate]
) -> None:
    """One JSON file with the settings, the summaries and every per-problem result, so re-analysis needs no re-run.

    Strict JSON (NaN and infinity as null), written atomically: a failure never leaves half a file.
    """
    run = {
        "config": dict(config),
        "average": {m: asdict(e) for m, e in avg.items()},
        "benchmarks": {name: asdict(e) for name, e in evaluations.items()},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(strict_json(run), indent=1, allow_nan=False))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _estimate(fields: Mapping) -> Estimate:
    return Estimate(**{key: math.nan if value is None else value for key, value in fields.items()})


def load_run(path: str | Path) -> dict[str, Evaluation]:
    """The evaluations of a run file written by save_run: benchmark -> Evaluation (null read back as NaN)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"run file {path} does not exist")
    try:
        benchmarks = json.loads(Path(path).read_text())["benchmarks"]
        return {
            name: Evaluation(
                int(e["k"]),
                [ProblemResult(**p) for p in e["problems"]],
                {m: _estimate(s) for m, s in e["summary"].items()},
            )
            for name, e in benchmarks.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # ValueError: bad JSON or not UTF-8 text
        raise ValueError(f"{path}: not a run file written by eval.py ({type(error).__name__}: {error})") from None


def _label(metric: str, k: int) -> str:
    return metric.replace("@k", f"@{k}")


def _value(metric: str, x: float, sign: str = "") -> str:
    """Rates as percentage points, length as tokens; sign="+" shows the sign of a difference."""
    return f"{x:{sign}.1f}" if metric == "length" else f"{100 * x:{sign}.1f}"


def summary_table(evaluations: Mapping[str, Evaluation], avg: Mapping[str, Estimate]) -> str:
    """Markdown: one row per benchmark and the average; each cell is mean ± se [bootstrap interval]."""
    k = next(iter(evaluations.values())).k
    header = ["benchmark", "problems"] + [_label(m, k) + (" (tokens)" if m == "length" else " (%)") for m in METRICS]
    rows = [(name, str(len(e.problems)), e.summary) for name, e in evaluations.items()]
    rows.append(("average", str(sum(len(e.problems) for e in evaluations.values())), avg))
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, count, summary in rows:
        cells = [
            f"{_value(m, s.mean)} ± {_value(m, s.se)} [{_value(m, s.lo)}, {_value(m, s.hi)}]"
            for m, s in ((m, summary[m]) for m in METRICS)
        ]
        lines.append("| " + " | ".join([name, count] + cells) + " |")
    return "\n".join(lines)


def comparison_table(gaps: Mapping[str, Mapping[str, Gap]], label_a: str, label_b: str, k: int) -> str:
    """Markdown: one row per benchmark and metric with both values, the gap, its se, z and the verdict."""
    lines = [f"| benchmark | metric | {label_a} | {label_b} | diff | se | z | verdict |", "|" + "---|" * 8]
    for name, by_metric in gaps.items():
        for metric, g in by_metric.items():
            verdict = "noise (abs z < 2)" if g.noise else "beyond noise"
            lines.append(
                f"| {name} | {_label(metric, k)} | {_value(metric, g.a)} | {_value(metric, g.b)} | "
                f"{_value(metric, g.diff, '+')} | {_value(metric, g.se)} | {g.z:.2f} | {verdict} |"
            )
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# sampling and grading


def evaluate(
    model,
    tokenizer,
    problems: Sequence[Mapping],
    *,
    k: int,
    n: int | None = None,
    temperature: float,
    top_p: float = 1.0,
    max_new_tokens: int,
    template: str = "boxed",
    system: str | None = None,
    thinking: bool = False,
    batch_size: int = 8,
    seed: int = 0,
    desc: str = "eval",
    progress: bool = True,
    finished: list[ProblemResult] | None = None,
    first_problem: int = 0,
    pool=None,
    code_limits=None,
) -> Evaluation:
    """Sample n (default k) completions for each problem {"problem", "answer", optional "id"}, grade them, and
    summarize Mean@k, Pass@k, Maj@k, completion length and truncation rate with their error bars.

    A code problem ({"task": "code", "tests", ...}) is graded by running each completion's program against its
    tests in sandbox.py, within code_limits (a sandbox.Limits; default its defaults); correct means every test
    passed. Maj@k then votes on the program's text: identical programs agree, equivalent ones written
    differently do not.

    template, system (None: the chat template's default system message) and thinking (enable_thinking for
    templates that read it) pose each problem as in training; only what follows a completion's last </think>
    is graded and voted on, and a thought that never closes is wrong.
    batch_size prompts are sampled together (batch_size * n rows, a bound on memory); a problem's samples depend
    on the seed and its index, not on batch_size. A problem without "id" is named by its index. first_problem
    is the index of problems[0] in its set: a slice of a set (a process's share) gets the whole set's samples.
    finished, an empty list, receives each problem's result as its batch is graded: a caller keeps the work done
    when a later batch fails or is interrupted. pool (a rollout.Pool) holds the sampler's KV cache across calls.
    """
    n = k if n is None else n
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be between 1 and the number of samples drawn per problem n={n}")
    if not problems:
        raise ValueError("problems is empty")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    stops, open_thought = stop_ids(model.config, tokenizer), opens_thought(tokenizer, thinking)
    was_training = model.training
    model.eval()  # no LoRA dropout while measuring
    results = [] if finished is None else finished
    # a bar only on a terminal: in a redirected log its carriage returns would be noise
    bar = tqdm(total=len(problems), desc=desc, unit="problem", disable=not (progress and sys.stderr.isatty()))
    try:
        for start in range(0, len(problems), batch_size):
            batch = problems[start : start + batch_size]
            prompts = [render_prompt(tokenizer, p["problem"], template, system, thinking) for p in batch]
            out = rollout.generate(
                model,
                prompts,
                samples_per_prompt=n,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                stop_ids=stops,
                seed=seed,
                first_prompt=first_problem + start,
                tokenizer=tokenizer,
                pool=pool,
            )
            references = [p for p in batch for _ in range(n)]  # rows are prompt-major; graded by their task
            correct = [
                score == 1.0
                for score in scoring.verdicts(
                    out.texts, references, template=template, open_thought=open_thought, code_limits=code_limits
                )[0]
            ]
            finals = [reward.split_thinking(t, open_thought).answer for t in out.texts]
            answers = [None if f is None else _answer(f, p, template) for f, p in zip(finals, references)]
            lengths, truncated = out.completion_mask.sum(1).tolist(), out.truncated.tolist()
            for i, p in enumerate(batch):
                rows = slice(i * n, (i + 1) * n)
                results.append(
                    ProblemResult(
                        str(p.get("id", first_problem + start + i)),
                        _reference(p),
                        out.texts[rows],
                        answers[rows],
                        correct[rows],
                        lengths[rows],
                        truncated[rows],
                    )
                )
            bar.update(len(batch))
    finally:
        bar.close()
        model.train(was_training)
    return Evaluation(k, results, summarize(results, k, seed=seed))


def _answer(text: str, problem: Mapping, template: str) -> str | None:
    """What Maj@k votes on: a math answer's normalized spelling as graded (reward.answer_of), so "\\dfrac12"
    and "\\frac{1}{2}" count as one answer; a code completion's program, stripped."""
    if problem.get("task") == "code":
        program = sandbox.extract_program(text)
        return None if program is None else program.strip()
    return reward.answer_of(text, template) or None


def _reference(problem: Mapping) -> str:
    """The reference a run file records: a math problem's answer; for a code problem, what its tests are."""
    if problem.get("task") == "code":
        return f"{len(problem['tests'])} {problem.get('style', 'stdio')} tests"
    return problem["answer"]


# -----------------------------------------------------------------------------
# a training run's held-out sets


def load_eval_sets(cfg: Config) -> dict[str, list[dict]]:
    """The held-out sets by name, each cut to eval_problems when that is set."""
    names = [name.strip() for name in cfg.eval_dataset.split(",") if name.strip()]
    if not names:
        raise ValueError("--eval-dataset: no dataset given")
    sets = {name: load_problems(name) for name in names}
    return {name: problems[: cfg.eval_problems] if cfg.eval_problems else problems for name, problems in sets.items()}


def held_out(
    model,
    tokenizer,
    eval_sets: dict[str, list[dict]],
    cfg: Config,
    desc: str,
    world: distributed.World | None = None,
    pool: rollout.Pool | None = None,
) -> dict:
    """A training run's held-out evaluation (train.py's before, every --eval-every steps and after): Mean@k
    and Pass@k on each set, sampled as the run samples; with several sets, accuracy is their unweighted mean.

    With several processes each rank evaluates a slice of each set (with the samples one process draws
    for those problems) and the per-problem results are gathered.
    """
    world = world or distributed.SOLO
    if world.rank == 0 and not sys.stderr.isatty():  # a log file has no progress bar: say what runs
        counts = ", ".join(f"{len(problems)} of {name}" for name, problems in eval_sets.items())
        print(f"{desc}: {counts} x {cfg.eval_k} samples", file=sys.stderr)
    result = _held_out(model, tokenizer, eval_sets, cfg, desc, world, pool)
    if world.rank == 0:
        se = f"{100 * result['se']:.1f}" if result["se"] is not None and math.isfinite(result["se"]) else "undefined"
        tqdm.write(
            f"{desc}: Mean@{cfg.eval_k} {100 * result['accuracy']:.1f}% (se {se}), Pass@{cfg.eval_k} "
            f"{100 * result['pass@k']:.1f}%, {result['problems']} problems",
            file=sys.stderr,
        )
    return result


def _held_out(
    model,
    tokenizer,
    eval_sets: dict[str, list[dict]],
    cfg: Config,
    desc: str,
    world: distributed.World,
    pool: rollout.Pool | None = None,
) -> dict:
    results = {}
    with sampling_policy(model, pool) as policy:  # a sharded model's weights, gathered once for every set
        for name, problems in eval_sets.items():
            lo, hi = (len(problems) * r // world.size for r in (world.rank, world.rank + 1))
            mine = []
            if hi > lo:
                with oom_hint(f"evaluation on {name}", f"lower --eval-batch (now {cfg.eval_batch} prompts per call)"):
                    mine = evaluate(
                        policy,
                        tokenizer,
                        problems[lo:hi],
                        k=cfg.eval_k,
                        code_limits=sandbox.Limits(timeout=cfg.code_timeout),
                        temperature=cfg.eval_temperature,
                        top_p=cfg.top_p,
                        max_new_tokens=cfg.max_new_tokens,
                        template=cfg.template,
                        system=cfg.system_prompt,
                        thinking=cfg.thinking == "on",
                        batch_size=cfg.eval_batch,
                        seed=cfg.seed,
                        first_problem=lo,
                        desc=f"{desc} {name}" if len(eval_sets) > 1 else desc,
                        progress=world.rank == 0,
                        pool=pool,
                    ).problems
            summary = summarize(sum(world.gather(mine), []), cfg.eval_k, seed=cfg.seed)
            mean = summary["mean@k"]
            results[name] = {
                "accuracy": mean.mean,
                "se": mean.se,
                "pass@k": summary["pass@k"].mean,
                "problems": len(problems),
                "k": cfg.eval_k,
            }
    if len(results) == 1:
        return next(iter(results.values()))
    parts = list(results.values())
    return {
        "accuracy": float(np.mean([p["accuracy"] for p in parts])),
        "se": math.sqrt(sum(p["se"] ** 2 for p in parts)) / len(parts),
        "pass@k": float(np.mean([p["pass@k"] for p in parts])),
        "problems": sum(p["problems"] for p in parts),
        "k": cfg.eval_k,
        "sets": results,
    }


# -----------------------------------------------------------------------------
# command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, not argparse's usage block: the message names the flag."""
        self.exit(2, f"eval.py: {message} (see --help)\n")


# flags a run's settings fill (eval.py flag -> the name in the run's config.json), and the defaults otherwise
RUN_SETTINGS = {
    "model": "model",
    "template": "template",
    "system": "system_prompt",
    "thinking": "thinking",
    "temperature": "eval_temperature",
    "top_p": "top_p",
    "max_new_tokens": "max_new_tokens",
    "k": "eval_k",
    "bench": "eval_dataset",
    "limit": "eval_problems",
    "seed": "seed",
    "dtype": "dtype",
    "code_timeout": "code_timeout",
}
DEFAULTS = {
    "bench": "aime24,aime25,amc23",
    "k": 8,
    "temperature": 0.6,
    "top_p": 0.95,
    "max_new_tokens": 4096,
    "template": "boxed",
    "seed": 0,
    "thinking": "off",
    "code_timeout": sandbox.Limits.timeout,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags, each checked here with a message naming it and its allowed values, before anything loads.

    With --run, the flags not given take the run's settings (args.from_run lists them), then the defaults."""
    parser = _Parser(description=__doc__.strip().splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--run",
        default=None,
        metavar="RUN",
        help="a train.py or sft.py run directory: its model, template, system prompt, sampling, held-out sets, k "
        "and last adapter (--checkpoint), unless flags say otherwise",
    )
    parser.add_argument(
        "--checkpoint",
        choices=("last", "best"),
        default="last",
        help="which policy of a run directory (--run, or --adapter RUN): its last, or the best on its validation "
        "split, a sample of its training set disjoint from the held-out sets (default: %(default)s)",
    )
    parser.add_argument(
        "--model", default=None, help="model directory or hub id (default: the offline SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--adapter",
        default=None,
        help="LoRA adapter directory (PEFT format) to load on the model, or a run directory (its --checkpoint)",
    )
    parser.add_argument(
        "--bench",
        default=None,
        help="comma-separated dataset names of data/ (see data/prepare.py) "
        f"or .jsonl/.json/.parquet paths (default: {DEFAULTS['bench']})",
    )
    parser.add_argument("--data-dir", default=None, help="where named datasets live (default: data/)")
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="evaluate only N problems of each "
        "benchmark (the first N, or a seeded sample with --limit-seed): a quick try",
    )
    parser.add_argument(
        "--limit-seed",
        type=int,
        default=None,
        metavar="S",
        help="with --limit: draw the N problems at random with this seed, kept in their benchmark order",
    )
    parser.add_argument("--k", type=int, default=None, help=f"k of Mean@k, Pass@k and Maj@k (default: {DEFAULTS['k']})")
    parser.add_argument(
        "--n",
        type=int,
        default=None,
        help="samples drawn per problem, at least k (default: k); more samples make the Pass@k estimate less noisy",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"sampling temperature, 0 = greedy (default: {DEFAULTS['temperature']})",
    )
    parser.add_argument(
        "--top-p", type=float, default=None, help=f"nucleus sampling mass (default: {DEFAULTS['top_p']})"
    )
    parser.add_argument("--max-new-tokens", type=int, default=None, help=f"(default: {DEFAULTS['max_new_tokens']})")
    parser.add_argument(
        "--template", default=None, help=f"prompt template of data/templates.py (default: {DEFAULTS['template']})"
    )
    parser.add_argument("--system", default=None, help="system message (default, or empty: the chat template's own)")
    parser.add_argument(
        "--thinking",
        default=None,
        choices=["on", "off"],
        help="enable_thinking for chat "
        "templates that take it (Qwen3); only what follows the last </think> is graded "
        f"(default: {DEFAULTS['thinking']})",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="problems sampled together (default: %(default)s)")
    parser.add_argument(
        "--code-timeout",
        type=float,
        default=None,
        help=f"code problems: seconds a program may run per test (default: {DEFAULTS['code_timeout']})",
    )
    parser.add_argument("--seed", type=int, default=None, help=f"(default: {DEFAULTS['seed']})")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on cuda, float32 on cpu"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="run file to write (default: RUN/eval-TIME.json with --run, else runs/eval-TIME.json)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        default=None,
        help="compare two run files problem by problem instead of evaluating",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="TABLE.json",
        help="JSON table {benchmark: {metric: "
        "{'mean': x, 'se': s}}} to compare the run(s) against; metrics " + ", ".join(METRICS) + ", rates as fractions",
    )
    args = parser.parse_args(argv)
    args.from_run = []
    if args.run is not None:
        try:
            args.from_run = take_run_settings(args)
        except (ValueError, OSError) as error:
            parser.error(str(error))
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.system = args.system or None  # empty: the chat template's own, as train.py reads it
    checks = [
        (args.k >= 1, f"--k {args.k}: must be >= 1"),
        (args.n is None or args.n >= args.k, f"--k {args.k} is larger than the --n {args.n} samples drawn per problem"),
        (args.limit is None or args.limit >= 1, f"--limit {args.limit}: must be >= 1"),
        (args.limit_seed is None or args.limit is not None, "--limit-seed needs --limit N"),
        (args.temperature >= 0 and math.isfinite(args.temperature), f"--temperature {args.temperature}: must be >= 0"),
        (0 < args.top_p <= 1, f"--top-p {args.top_p}: must be in (0, 1]"),
        (args.max_new_tokens >= 1, f"--max-new-tokens {args.max_new_tokens}: must be >= 1"),
        (args.batch_size >= 1, f"--batch-size {args.batch_size}: must be >= 1"),
        (
            args.code_timeout > 0 and math.isfinite(args.code_timeout),
            f"--code-timeout {args.code_timeout}: must be a positive number of seconds",
        ),
    ]
    for ok, message in checks:
        if not ok:
            parser.error(message)
    try:
        user_message("", args.template)
    except ValueError as error:
        parser.error(f"--template: {error}")
    return args


def take_run_settings(args: argparse.Namespace) -> list[str]:
    """Fill the flags not given from the run's config.json and point --adapter at its best adapter (a full run's
    --model at its best weights); returns the names filled. A run's automatic values (dtype auto, eval_problems
    0 = all) leave eval.py's own defaults."""
    saved_file = Path(args.run) / "config.json"
    if not saved_file.is_file():
        raise FileNotFoundError(f"--run {args.run}: not a run directory of train.py or sft.py (no config.json)")
    try:
        saved = json.loads(saved_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"--run {args.run}: {saved_file} is not valid JSON ({error})") from None
    if "batch_tokens" in saved:  # an sft.py run: it samples its held-out sets with evaluate's own top_p
        saved = {**saved, "top_p": inspect.signature(evaluate).parameters["top_p"].default}
    filled = []
    for flag, key in RUN_SETTINGS.items():
        value = saved.get(key)
        if not hasattr(args, flag) or getattr(args, flag) is not None or key not in saved:
            continue  # given on the command line, or a setting this run or this eval.py does not have
        if (flag, value) in (("dtype", "auto"), ("limit", 0), ("bench", "")):  # automatic, or no set of its own
            continue
        setattr(args, flag, value)
        filled.append(flag)
    if saved.get("lora_rank") == 0:  # every weight trained: the run's best weights are a model of their own
        best = Path(args.run) / "best"
        if "model" in filled:
            if args.checkpoint == "last" or not (best / "config.json").is_file():
                raise FileNotFoundError(
                    f"--run {args.run}: a full-parameter run's last weights are sharded in its checkpoint; export "
                    f"them (python train.py --resume {args.run} --steps 0 --export DIR) and evaluate --model DIR"
                    + ("" if args.checkpoint == "last" else "; it has no best weights yet")
                )
            args.model = str(best)
        return filled
    if args.adapter is None:
        args.adapter = args.run
        filled.append("adapter")
    return filled


def resolve_adapter(path: str, checkpoint: str = "last") -> tuple[Path, str]:
    """(adapter directory, what it is): a PEFT adapter directory as given, or a run directory's last adapter
    (an sft.py run's adapter, else its newest checkpoint's) or, with checkpoint "best", the adapter best on its
    validation split. The default is the last: a best chosen during training is a selection, and the run chose
    it on its validation split, never on the held-out sets. A ValueError naming --adapter when it is neither."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"--adapter: directory {path} does not exist")
    if (folder / "adapter_config.json").is_file():
        return folder, "as given"
    if checkpoint == "best":
        if not (folder / "best" / "adapter_config.json").is_file():
            raise ValueError(f"--adapter {path} --checkpoint best: the run has no best adapter yet")
        summary_file = folder / "summary.json"
        best = json.loads(summary_file.read_text()).get("best") if summary_file.is_file() else None
        what = (
            f"the run's best on its validation split: accuracy {100 * best['accuracy']:.1f}% at step {best['step']}"
            if isinstance(best, dict)
            else "the run's best on its validation split so far"
        )
        return folder / "best", what
    if (folder / "adapter" / "adapter_config.json").is_file():  # an sft.py run's: at its end, or when it stopped
        return folder / "adapter", "the supervised run's adapter"
    latest = folder / "latest"
    if latest.is_file() and (folder / latest.read_text().strip() / "adapter" / "adapter_config.json").is_file():
        name = latest.read_text().strip()
        return folder / name / "adapter", f"the run's last adapter ({name})"
    raise ValueError(f"--adapter {path}: neither an adapter (no adapter_config.json) nor a run directory with one")


def settings_line(args: argparse.Namespace, adapter: Path | None, adapter_what: str) -> str:
    """The command these settings are, for the reader to see (and rerun) what was evaluated."""
    flags = [
        ("--model", args.model),
        ("--adapter", adapter),
        ("--bench", args.bench),
        ("--limit", args.limit),
        ("--k", args.k),
        ("--temperature", args.temperature),
        ("--top-p", args.top_p),
        ("--max-new-tokens", args.max_new_tokens),
        ("--template", args.template),
        ("--system", args.system),
        ("--seed", args.seed),
        ("--thinking", args.thinking),
    ]
    command = " ".join(f"{flag} {shlex.quote(str(value))}" for flag, value in flags if value is not None)
    given = [flag for flag in RUN_SETTINGS if flag not in args.from_run and hasattr(args, flag)]
    return (
        f"eval.py: {args.run} evaluated as: python eval.py {command}\neval.py: adapter {adapter} "
        f"({adapter_what}); from the run: {', '.join(args.from_run) or 'nothing'}; yours or eval.py's defaults: "
        f"{', '.join(given) or 'none'}"
    )


def limit_problems(problems: Sequence[Mapping], limit: int | None, seed: int | None = None) -> list[dict]:
    """The first `limit` problems, or with a seed a random `limit` of them in their original order.

    A problem without "id" gets its position in the full benchmark as id, so a limited run pairs with a full one
    under --compare.
    """
    named = [{**p, "id": p.get("id", index)} for index, p in enumerate(problems)]
    if limit is None or limit >= len(named):
        return named
    if seed is None:
        return named[:limit]
    return [named[i] for i in sorted(random.Random(seed).sample(range(len(named)), limit))]


def check_writable(path: Path, flag: str) -> None:
    """Fail now, not after the evaluation, when `path` cannot be written (ValueError naming the flag).

    Tries what saving will do: append to the file when it exists, else create a file in the nearest existing
    folder above it (the folders in between are made when saving). Nothing is left behind.
    """
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file name such as {path / 'eval.json'}")
    folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    try:
        if path.exists():
            with open(path, "a"):
                pass
        elif not folder.is_dir():
            raise NotADirectoryError(0, f"{folder} is a file, not a folder")
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot write there ({error.strerror})") from None


def check_device(device: str) -> None:
    """A ValueError naming --device when torch does not know the device or this machine has none of it."""
    try:
        kind = torch.device(device).type
    except RuntimeError as error:
        raise ValueError(f"--device {device}: {error}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here; use --device cpu")


def _load_baseline(path: str) -> dict:
    if not Path(path).is_file():
        raise FileNotFoundError(f"--baseline: {path} does not exist")
    try:
        return json.loads(Path(path).read_text())
    except ValueError as error:  # bad JSON, or not UTF-8 text
        raise ValueError(f"--baseline: {path} is not valid JSON ({error})") from None


def _print_baseline(run: Mapping[str, Evaluation], baseline: Mapping, label: str) -> None:
    k = next(iter(run.values())).k
    print(f"\n{label} against the baseline (se combines both; the baseline's se counts as 0 where missing)\n")
    print(comparison_table(compare_to_baseline(run, baseline), "baseline", label, k))


def run_compare(path_a: str, path_b: str, baseline_path: str | None = None) -> None:
    """Print the paired comparison of two run files, and each against the baseline table when given."""
    run_a, run_b = load_run(path_a), load_run(path_b)
    baseline = _load_baseline(baseline_path) if baseline_path else None
    gaps = compare(run_a, run_b)
    print(f"A = {path_a}\nB = {path_b}\npaired on problems; a gap with abs(z) < 2 is within noise\n")
    print(comparison_table(gaps, "A", "B", next(iter(run_a.values())).k))
    for label, run, other in (("A", run_a, run_b), ("B", run_b, run_a)):
        if skipped := sorted(run.keys() - other.keys()):
            print(f"not compared, only in {label}: {', '.join(skipped)}")
    if baseline is not None:
        _print_baseline(run_a, baseline, "A")
        _print_baseline(run_b, baseline, "B")


def load_benchmarks(args: argparse.Namespace) -> dict[str, list[dict]]:
    """Benchmark name -> its problems (after --limit), read and checked before any model loads."""
    names = [name.strip() for name in args.bench.split(",") if name.strip()]
    if not names:
        raise ValueError("--bench: no benchmark given")
    data_dir = {} if args.data_dir is None else {"data_dir": args.data_dir}
    return {
        Path(name).stem if name.endswith((".jsonl", ".json", ".parquet")) else name: limit_problems(
            load_problems(name, **data_dir), args.limit, args.limit_seed
        )
        for name in names
    }


def save_partial(
    out: Path, config: Mapping, finished: Mapping[str, list[ProblemResult]], k: int, seed: int
) -> Path | None:
    """After a late failure, the problems finished so far as a run file beside `out` (OUT.partial.json), or in
    the temporary folder when that cannot be written either; None when nothing was finished."""
    evaluations = {
        name: Evaluation(k, results, summarize(results, k, seed=seed)) for name, results in finished.items() if results
    }
    if not evaluations:
        return None
    for folder in (out.parent, Path(tempfile.gettempdir())):
        path = folder / f"{out.stem}.partial{out.suffix}"
        try:
            save_run(path, {**config, "partial": True}, evaluations, average(evaluations, seed=seed))
            return path
        except OSError:
            continue
    return None


def _keep_finished(out: Path, config: Mapping, finished: Mapping[str, list[ProblemResult]], k: int, seed: int) -> str:
    kept = save_partial(out, config, finished, k, seed)
    count = sum(len(results) for results in finished.values())
    return f"the {count} problems finished are in {kept}" if kept else "no finished problem could be kept"


def run_eval(
    args: argparse.Namespace, benchmarks: Mapping[str, list[dict]], out: Path, model, tokenizer, config: Mapping
) -> dict[str, Evaluation]:
    """Sample, grade, print the table and write the run file; a late failure keeps what was finished."""
    finished = {name: [] for name in benchmarks}
    try:
        evaluations = {
            name: evaluate(
                model,
                tokenizer,
                problems,
                k=args.k,
                n=args.n,
                temperature=args.temperature,
                top_p=args.top_p,
                max_new_tokens=args.max_new_tokens,
                template=args.template,
                system=args.system,
                thinking=args.thinking == "on",
                batch_size=args.batch_size,
                seed=args.seed,
                desc=name,
                finished=finished[name],
                code_limits=sandbox.Limits(timeout=args.code_timeout),
            )
            for name, problems in benchmarks.items()
        }
    except KeyboardInterrupt:
        print(f"\neval.py: interrupted; {_keep_finished(out, config, finished, args.k, args.seed)}", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception:
        print(
            f"eval.py: the evaluation failed; {_keep_finished(out, config, finished, args.k, args.seed)}",
            file=sys.stderr,
        )
        raise
    avg = average(evaluations, seed=args.seed)
    print(f"\nk={args.k}, n={args.n or args.k} samples per problem; mean ± se [{LEVEL:.0%} bootstrap interval]\n")
    print(summary_table(evaluations, avg))
    try:
        save_run(out, config, evaluations, avg)
    except OSError as error:
        print(
            f"eval.py: --out {out}: cannot write ({error.strerror or error}); "
            f"{_keep_finished(out, config, finished, args.k, args.seed)}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    print(f"\nper-problem results: {out}")
    return evaluations


def main(argv: Sequence[str] | None = None) -> None:
    """The command line. Mistakes in flags and input files print one line and exit with status 2, before any
    model loads; errors inside the evaluation keep their traceback."""
    args = parse_args(argv)
    try:
        if args.compare:
            run_compare(*args.compare, args.baseline)
            return
        adapter, adapter_what = (
            resolve_adapter(args.adapter, args.checkpoint) if args.adapter is not None else (None, "")
        )
        baseline = _load_baseline(args.baseline) if args.baseline else None
        benchmarks = load_benchmarks(args)
        out = Path(args.out or f"{args.run or 'runs'}/eval-{time.strftime('%Y%m%d-%H%M%S')}.json")
        if out.is_file() and not args.force:
            raise ValueError(f"--out {out} already exists; pass --force to overwrite it, or name another file")
        check_writable(out, "--out")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        check_device(device)
        dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
        if args.run is not None:
            print(settings_line(args, adapter, adapter_what), file=sys.stderr)
        model = from_pretrained(args.model, dtype=dtype, device=device)
        if adapter is not None:
            lora.load(model, adapter)
        tokenizer = load_tokenizer(args.model)
        if note := thinking_note(tokenizer, args.thinking == "on"):
            print(f"eval.py: {note}", file=sys.stderr)
    except (ValueError, OSError) as error:
        print(f"eval.py: {error}", file=sys.stderr)
        raise SystemExit(2) from None

    config = {key: value for key, value in vars(args).items() if key not in ("compare", "out", "force")}
    config.update(
        n=args.n or args.k, device=device, dtype=str(dtype), adapter=None if adapter is None else str(adapter)
    )
    evaluations = run_eval(args, benchmarks, out, model, tokenizer, config)
    if baseline is not None:
        _print_baseline(evaluations, baseline, "run")


if __name__ == "__main__":
    main()
