"""
Pictures of training runs: reward, accuracy and held-out accuracy, entropy, completion length, clipping, KL,
gradient norm and speed, fit for a report.

    python -m research.plot runs/A [runs/B ...] [--out DIR] [--smooth N]
    python -m research.plot --counterfactual runs/counterfactual [--out DIR]

Reads each run directory that train.py or sft.py wrote (metrics.jsonl: one JSON object a step; summary.json: the
held-out accuracy before and after training; config.json: its settings) and writes one PNG per figure, printing
each path. Several runs are drawn on the same axes, one colour per run, named by their directories (told apart by
their paths, or by a number, when two share a name): that is how two rules are compared. A metric that no run
logged is left out, and a figure with nothing to show is not written. Every panel's axis says what it counts and
in which unit, and starts at 0 (an axis that must go below it, for negative values, includes 0); a figure of one
run is titled by its name; a panel whose metric depends on a setting (the length cap, k) names it; the clip table
prints its percentages and the tokens each is over in cells large enough to read on paper. An sft.py run draws its
loss. With --counterfactual
it draws the table of counterfactual.py instead (its results.json): every arm's paired gap to grpo per
measure, and the clip rate by old probability.
"""

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

BUCKET_CLIP = re.compile(r"mu\[(.+)\]/clip_frac")  # loss.py's per-old-probability-bucket clipped fraction


@dataclass
class Panel:
    title: str
    keys: tuple[str, ...]  # metrics.jsonl keys drawn on this axis, one line style each; "rewards/*": every such key
    ylabel: str  # what the axis counts, with its unit
    fraction: bool = False  # a share in [0, 1]: the axis runs from 0 to at most 1
    setting: str | None = None  # a config.json setting the metric depends on, named in the title


TOKENS = "fraction of completion tokens"
# file name -> panels; a panel shows up when any run logged one of its keys
FIGURES = {
    "loss": [Panel("supervised loss (sft.py)", ("loss",), "cross-entropy, nats per reply token")],
    "reward": [
        Panel("training reward", ("reward",), "reward per completion (mean)"),
        Panel(
            "training accuracy (the answer checker)", ("accuracy",), "fraction of completions correct", fraction=True
        ),
        Panel("reward of each function (--reward-fn)", ("rewards/*",), "reward per completion (mean)"),
    ],
    "entropy": [Panel("policy entropy", ("entropy",), "nats per completion token")],
    "length": [
        Panel("completion length", ("completion_length",), "tokens per completion (mean)", setting="max_new_tokens"),
        Panel(
            "truncated at the cap", ("truncated",), "fraction of completions", fraction=True, setting="max_new_tokens"
        ),
    ],
    "clipping": [
        Panel(
            "clip rate: acting tokens after a rollout's first update",
            ("clip_rate",),
            "fraction of tokens with A != 0",
            fraction=True,
        ),
        Panel("clipped below (ratio under its lower bound)", ("clip_low_frac",), TOKENS, fraction=True),
        Panel("clipped above (ratio over its upper bound)", ("clip_high_frac",), TOKENS, fraction=True),
        Panel("stopped by --ratio-limits or --dual-clip", ("limit_clip_frac",), TOKENS, fraction=True),
    ],
    "kl": [
        Panel("KL to the sampling policy (k3 estimate)", ("approx_kl",), "nats per completion token"),
        Panel("KL to the reference policy", ("ref_kl",), "nats per completion token"),
    ],
    "grad_norm": [
        Panel("gradient norm before clipping", ("grad_norm",), "L2 norm of the adapters' gradient (no unit)")
    ],
    "speed": [
        Panel("step time", ("step_seconds",), "seconds per step"),
        Panel("throughput", ("rollout_tokens_per_s", "train_tokens_per_s"), "tokens per second"),
    ],
}
KEY_LABELS = {"rollout_tokens_per_s": "sampling", "train_tokens_per_s": "training"}  # a legend's words for a key
LINE_STYLES = ("-", "--", ":", "-.")


@dataclass
class Run:
    name: str
    records: list[dict]  # one per step, in step order
    summary: dict  # summary.json; {} when the run has none yet
    settings: dict  # config.json; {} when the run has none

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) over the steps that logged `key` as a number or null (NaN: a gap in the line)."""
        points = [
            (r["step"], math.nan if r[key] is None else r[key])
            for r in self.records
            if key in r and (r[key] is None or isinstance(r[key], (int, float)))
        ]
        steps, values = zip(*points) if points else ((), ())
        return np.array(steps, dtype=float), np.array(values, dtype=float)


def load_run(path: Path, name: str) -> Run:
    """A run directory's metrics (the last record of each step, so a resumed run's repeats count once)."""
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise ValueError(f"{path}: no such run directory")
    if not metrics.is_file():
        raise ValueError(f"{path}: no metrics.jsonl in it; expected a run directory written by train.py or sft.py")
    by_step = {}
    for number, line in enumerate(metrics.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{metrics}:{number}: invalid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f'{metrics}:{number}: expected a JSON object with an integer "step"')
        if "event" not in record:  # a resume's note of changed settings, not a step
            by_step[record["step"]] = record
    summary, settings = (read_object(path / name) for name in ("summary.json", "config.json"))
    return Run(name, [by_step[step] for step in sorted(by_step)], summary, settings)


def read_object(path: Path) -> dict:
    """A run's JSON object file; {} when it is absent (a run still going has no summary yet)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: invalid JSON ({error.msg})") from None
    return data if isinstance(data, dict) else {}


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of each value and the window - 1 before it, skipping NaN; NaN where the window holds none."""
    valid = ~np.isnan(values)
    kernel = np.ones(window)
    sums = np.convolve(np.where(valid, values, 0.0), kernel)[: len(values)]
    counts = np.convolve(valid.astype(float), kernel)[: len(values)]
    return np.divide(sums, counts, out=np.full(len(values), np.nan), where=counts > 0)


def draw_line(ax, steps: np.ndarray, values: np.ndarray, color, style: str, label: str, smooth: int) -> None:
    """One metric of one run; with smoothing the raw values stay visible, faint, behind the trailing mean."""
    marker = "o" if len(steps) <= 30 else None  # a short run's points would otherwise vanish (one step: no line)
    if smooth > 1:
        ax.plot(steps, values, style, color=color, alpha=0.25, linewidth=1)
        values = trailing_mean(values, smooth)
    ax.plot(steps, values, style, color=color, marker=marker, markersize=3, linewidth=1.5, label=label)


def _label(run: Run, key: str, runs: Sequence[Run], keys: Sequence[str]) -> str:
    """The run's name when there are several runs, the metric's when the panel has several; "" (no legend) else."""
    metric = KEY_LABELS.get(key, key.removeprefix("rewards/"))  # a reward function by its name
    return " ".join(([run.name] if len(runs) > 1 else []) + ([metric] if len(keys) > 1 else []))


def logged(panel: Panel, runs: Sequence[Run]) -> list[str]:
    """The panel's keys that at least one run logged; "prefix/*" stands for every key under prefix/."""
    keys = []
    for key in panel.keys:
        if key.endswith("*"):
            keys += sorted({k for run in runs for record in run.records for k in record if k.startswith(key[:-1])})
        else:
            keys.append(key)
    return [key for key in dict.fromkeys(keys) if any(len(run.series(key)[0]) for run in runs)]


def draw_panel(ax, panel: Panel, runs: Sequence[Run], colors, smooth: int) -> None:
    """The panel's metrics for every run: colour tells the run, line style the metric."""
    keys = logged(panel, runs)
    for run, color in zip(runs, colors):
        for key, style in zip(keys, LINE_STYLES):
            steps, values = run.series(key)
            if len(steps):
                draw_line(ax, steps, values, color, style, _label(run, key, runs, keys), smooth)
    ax.set(title=panel.title + setting_note(panel.setting, runs), xlabel="step", ylabel=panel.ylabel)
    from_zero(ax, fraction=panel.fraction)


def setting_note(name: str | None, runs: Sequence[Run]) -> str:
    """A title's note of a setting the runs logged, as "(--max-new-tokens 16)" on a line of its own, each run's
    value where they differ; "" where none logged it."""
    values = {  # a GPPO cell's rule is a pair in config.json: kl-atomic
        run.name: "-".join(map(str, value)) if isinstance(value, list) else value
        for run in runs
        if name and (value := run.settings.get(name)) is not None
    }
    if not values:
        return ""
    shown = (
        str(next(iter(values.values())))
        if len(set(map(str, values.values()))) == 1
        else ", ".join(f"{value} ({run})" for run, value in values.items())
    )
    return f"\n(--{name.replace('_', '-')} {shown})"


def from_zero(ax, fraction: bool = True) -> None:
    """The axis from 0, so that a small change does not look like a large one: a share's (all-zero data would
    otherwise be centred on it, showing negative shares) up to just above the largest value and never far
    past 1; another axis up to its data, and down past 0 only for negative values, 0 then still shown."""
    bottom, top = ax.get_ylim()
    data = [line.get_ydata() for line in ax.lines] + [
        c.get_offsets()[:, 1] for c in ax.collections if len(c.get_offsets())
    ]
    lowest = min((float(np.nanmin(d)) for d in data if np.isfinite(np.asarray(d, dtype=float)).any()), default=0.0)
    if fraction:
        ax.set_ylim(0.0, min(max(top, 0.01), 1.05))
    else:
        ax.set_ylim(0.0 if lowest >= 0 else min(bottom, 0.0), max(top, 1e-9))
    for artist in [*ax.lines, *ax.collections]:
        artist.set_clip_on(False)  # a point at 0 shows whole, on the axis


def held_out_points(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, accuracy, se) of the periodic evaluations, with summary.json's before at step 0 and after at the
    last step; an unknown se (one problem) is drawn without an error bar."""
    points = [(0, run.summary["before"])] if isinstance(run.summary.get("before"), dict) else []
    points += [(r["step"], r["eval"]) for r in run.records if isinstance(r.get("eval"), dict)]
    if isinstance(run.summary.get("after"), dict) and run.records:
        points.append((run.records[-1]["step"], run.summary["after"]))
    points = [(step, e) for step, e in points if isinstance(e.get("accuracy"), (int, float))]
    steps = np.array([step for step, _ in points], dtype=float)
    accuracy = np.array([e["accuracy"] for _, e in points], dtype=float)
    se = np.array([e["se"] if isinstance(e.get("se"), (int, float)) else 0.0 for _, e in points], dtype=float)
    return steps, accuracy, se


def held_out_k(runs: Sequence[Run]) -> str:
    """The k of the runs' held-out Mean@k: "8", or "4, 8" when runs differ, or "k" when none says."""
    ks = set()
    for run in runs:
        evaluations = [run.summary.get("before"), run.summary.get("after"), *(r.get("eval") for r in run.records)]
        ks |= {e["k"] for e in evaluations if isinstance(e, dict) and isinstance(e.get("k"), int)}
    return ", ".join(map(str, sorted(ks))) or "k"


def draw_held_out(ax, runs: Sequence[Run], colors) -> None:
    for run, color in zip(runs, colors):
        steps, accuracy, se = held_out_points(run)
        if len(steps):
            ax.errorbar(
                steps,
                accuracy,
                yerr=se,
                color=color,
                marker="o",
                markersize=4,
                capsize=3,
                label=run.name if len(runs) > 1 else None,
            )
    k = held_out_k(runs)
    label = f"Mean@{k}" if "," not in k else f"Mean@k (k = {k})"
    ax.set(title="held-out accuracy (± se over problems)", xlabel="step", ylabel=f"{label}, fraction correct")
    from_zero(ax)


def finish_axes(ax) -> None:
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def write(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def bucket_labels(runs: Sequence[Run]) -> list[str]:
    """The old-probability bucket labels in the order the runs logged them (loss.py: <0.01 up to >0.9)."""
    labels = {}
    for run in runs:
        for record in run.records:
            labels.update((m[1], None) for key in record if (m := BUCKET_CLIP.fullmatch(key)))
    return list(labels)


def bucket_tokens(record: dict, label: str) -> float:
    """The tokens a step's clipped fraction in one bucket is over (bucket_clipped); NaN where not logged."""
    count = record.get(f"mu[{label}]/clip_rate_tokens")
    return float(count) if isinstance(count, (int, float)) and f"mu[{label}]/clip_rate" in record else np.nan


def bucket_clipped(record: dict, label: str) -> float:
    """A step's clipped fraction in one old-probability bucket, region and limits together; NaN if not logged,
    or if the bucket held no token that step (nothing to clip is not "none clipped"). Where the step logged its
    clip rate (train.py's mu[BUCKET]/clip_rate: the bucket's tokens with non-zero advantage, after the rollout's
    first update) it is that, NaN when none of them was there; else the count over all the bucket's tokens."""
    if f"mu[{label}]/clip_rate" in record:
        rate = record[f"mu[{label}]/clip_rate"]
        return np.nan if rate is None else rate
    region, limit = record.get(f"mu[{label}]/clip_frac"), record.get(f"mu[{label}]/limit_frac")
    if region is None or record.get(f"mu[{label}]/share") == 0:
        return np.nan
    return region + (limit or 0.0)


def draw_bucket_table(runs: Sequence[Run]):
    """The clipped fraction per old-probability bucket (rows) and step (columns), one heat map per run on one
    colour scale: where a rule clips, and how that moves during training. A token counts when the rule's
    region or the outer limits / dual clip stopped it (loss.py logs the two apart, and they never overlap),
    so a limits-only arm is not drawn empty. None when no run logged it."""
    labels = bucket_labels(runs)
    tables = []
    for run in runs:
        steps = np.array([r["step"] for r in run.records], dtype=float)
        table = np.array([[bucket_clipped(r, label) for r in run.records] for label in labels])  # [buckets, steps]
        counts = np.array([[bucket_tokens(r, label) for r in run.records] for label in labels])  # [buckets, steps]
        if labels and len(steps) and not np.isnan(table).all():
            tables.append((run, steps, table, counts))
    if not tables:
        return None
    top = 100 * max(float(np.nanmax(table)) for _, _, table, _ in tables) or 1.0  # percent; all zero: a scale
    most = max(len(steps) for _, steps, _, _ in tables)
    numbers = most <= 12  # few steps: each cell prints its percentage, large enough to read on paper
    width = min(16.0, max(9.0, 0.8 * most + 3)) if numbers else 10.0
    fig, axes = plt.subplots(len(tables), 1, figsize=(width, 0.55 * len(labels) + 2.4 * len(tables)), squeeze=False)
    for ax, (run, steps, table, counts) in zip(axes[:, 0], tables):
        percent = 100 * table
        middle = (steps[:-1] + steps[1:]) / 2
        edges = np.concatenate([[steps[0] - 0.5], middle, [steps[-1] + 0.5]])  # a cell per step, gaps allowed
        mesh = ax.pcolormesh(
            edges, np.arange(len(labels) + 1), np.ma.masked_invalid(percent), vmin=0.0, vmax=top, cmap="viridis"
        )
        ax.set_facecolor("0.85")  # a bucket with no token that step
        ax.set_yticks(np.arange(len(labels)) + 0.5, labels, fontsize=11)
        ax.tick_params(axis="x", labelsize=11)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        honest = any(f"mu[{labels[0]}]/clip_rate" in r for r in run.records)
        rule = " ".join(setting_note(name, [run]).strip() for name in ("rule", "delta") if name in run.settings)
        ax.set_title(
            f"{run.name}{' ' * bool(rule)}{rule}: clipped by the region or the limits, per old probability (grey: no token)"
            + ("\nof the tokens with A != 0 after a rollout's first update (n: how many)" if honest else ""),
            fontsize=12,
        )
        ax.set_xlabel("step", fontsize=11)
        ax.set_ylabel("old probability of the token", fontsize=11)
        bar = fig.colorbar(mesh, ax=ax)
        bar.set_label("clipped, % of the bucket's tokens", fontsize=11)
        if numbers:
            for row, column in np.ndindex(percent.shape):
                if np.isfinite(percent[row, column]):
                    ax.text(
                        (edges[column] + edges[column + 1]) / 2,
                        row + 0.5,
                        f"{percent[row, column]:.1f}"
                        + (f"\nn={counts[row, column]:.0f}" if np.isfinite(counts[row, column]) else ""),
                        ha="center",
                        va="center",
                        fontsize=11,
                        color="white" if percent[row, column] < top / 2 else "k",
                    )
    return fig


def figures(runs: Sequence[Run], smooth: int = 1) -> dict[str, plt.Figure]:
    """Every figure that has data, by file name, with only the panels that have data."""
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    made = {}
    for name, panels in FIGURES.items():
        panels = [panel for panel in panels if logged(panel, runs)]
        held_out = name == "reward" and any(len(held_out_points(run)[0]) for run in runs)
        count = len(panels) + held_out
        if not count:
            continue
        columns = 2 if count == 4 else min(count, 3)  # a full grid: no empty slot
        rows = math.ceil(count / columns)
        fig, grid = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.9 * rows), squeeze=False)
        axes = list(grid.flat)
        for ax in axes[count:]:
            fig.delaxes(ax)
        for ax, panel in zip(axes, panels):
            draw_panel(ax, panel, runs, colors, smooth)
        if held_out:
            draw_held_out(axes[count - 1], runs, colors)
        for ax in axes[:count]:
            finish_axes(ax)
        if len(runs) == 1:
            fig.suptitle(runs[0].name, fontsize=13)
        made[name] = fig
    if table := draw_bucket_table(runs):
        made["clip_buckets"] = table
    return made


def plot_runs(runs: Sequence[Run], out: Path, smooth: int = 1) -> list[Path]:
    """Write every figure that has data into `out` as NAME.png; returns the files."""
    return [write(fig, out / f"{name}.png") for name, fig in figures(runs, smooth).items()]


def run_names(paths: Sequence[Path]) -> list[str]:
    """Directory names, or the paths as given where two runs share a name, numbered where those are the same
    too (one run given twice): every legend entry names one line."""
    names = [path.name or str(path) for path in paths]
    names = [name if names.count(name) == 1 else str(path) for name, path in zip(names, paths)]
    return [name if names.count(name) == 1 else f"{name} #{names[:i].count(name) + 1}" for i, name in enumerate(names)]


def default_out(paths: Sequence[Path], names: Sequence[str]) -> Path:
    if len(paths) == 1:
        return paths[0] / "plots"
    return paths[0].resolve().parent / ("plots-" + "-vs-".join(Path(name).name for name in names))


def fail(message: str):
    """A user's mistake: one line, exit status 2, no traceback."""
    print(f"plot.py: {message}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, not argparse's usage block."""
        self.exit(2, f"plot.py: {message} (see --help)\n")


# ----------------------------------------------------------------------------- counterfactual.py's table


def plot_counterfactual(results: dict, out: Path) -> list[Path]:
    """Two figures of counterfactual.py's results: gaps.png, each arm's paired gap to grpo per measure with
    its 95% interval (filled where the gap is called a difference), and clip_buckets.png, each arm's clip rate
    by old probability (acting tokens, ± se over rollouts)."""
    measures, gaps, means = results["measures"], results["gaps"], results["means"]
    arms = list(means)
    written = []
    if gaps:
        columns = 3
        rows = math.ceil(len(measures) / columns)
        fig, grid = plt.subplots(
            rows, columns, figsize=(5 * columns, max(2.6, 0.35 * len(gaps) + 1.4) * rows), squeeze=False
        )
        for ax in list(grid.flat)[len(measures) :]:
            fig.delaxes(ax)
        for ax, (measure, (heading, scale, _)) in zip(grid.flat, measures.items()):
            names = list(gaps)
            for y, arm in enumerate(names):
                c = gaps[arm][measure]
                if c["gap"] is None:
                    continue
                half = (c["ci95"] or 0.0) * scale
                ax.errorbar(
                    c["gap"] * scale,
                    y,
                    xerr=half,
                    fmt="o",
                    color="C0" if c["called"] else "0.5",
                    markerfacecolor="C0" if c["called"] else "white",
                    capsize=3,
                )
            ax.axvline(0, color="k", linewidth=0.8)
            ax.set_yticks(range(len(names)), names)
            ax.invert_yaxis()
            ax.set(title=f"{heading}: arm - grpo", xlabel="paired gap (95% interval)")
            ax.grid(alpha=0.3, axis="x")
        written.append(write(fig, out / "gaps.png"))
    labels = [key[len("clip[") : -1] for key in next(iter(means.values())) if key.startswith("clip[")]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(arms) * len(labels) / 3), 4.2))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        rates = [means[arm][f"clip[{label}]"] for label in labels]
        heights = [np.nan if m is None else 100 * m for m, _ in rates]
        errors = [0 if se is None else 100 * se for _, se in rates]
        ax.bar(
            np.arange(len(labels)) + (i - (len(arms) - 1) / 2) * width,
            heights,
            width,
            yerr=errors,
            label=arm,
            color=plt.get_cmap("tab10")(i % 10),
            capsize=2,
        )
    ax.set_xticks(range(len(labels)), [f"μ {label}" for label in labels])
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set(
        title="clipped % of the acting tokens after a rollout's first update, by old probability μ",
        ylabel="% clipped (± se over rollouts)",
    )
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncol=2)
    written.append(write(fig, out / "clip_buckets.png"))
    return written


def load_counterfactual(path: Path) -> dict:
    results = path / "results.json"
    if not results.is_file():
        raise ValueError(f"--counterfactual {path}: no results.json in it; expected a counterfactual.py directory")
    try:
        data = json.loads(results.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{results}: invalid JSON ({error.msg})") from None
    if not isinstance(data, dict) or not {"measures", "means", "gaps"} <= data.keys():
        raise ValueError(f"{results}: not counterfactual.py's results (no measures, means and gaps)")
    return data


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = _Parser(description=" ".join(__doc__.strip().split("\n\n")[0].split()), allow_abbrev=False)
    parser.add_argument("runs", nargs="*", type=Path, help="run directories written by train.py or sft.py (runs/NAME)")
    parser.add_argument(
        "--counterfactual",
        type=Path,
        default=None,
        metavar="DIR",
        help="draw counterfactual.py's table from DIR/results.json instead of runs",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the PNG files (default: RUN/plots for one run, plots-A-vs-B beside the first run for several)",
    )
    parser.add_argument(
        "--smooth",
        type=int,
        default=1,
        metavar="N",
        help="draw the trailing mean over N steps, the raw values faint behind it (default: 1, no smoothing)",
    )
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth {args.smooth}: must be >= 1")
    if (args.counterfactual is None) == (not args.runs):
        parser.error("give run directories, or --counterfactual DIR alone")
    if args.counterfactual is not None:
        out = args.out or args.counterfactual / "figures"
        try:
            results = load_counterfactual(args.counterfactual)
            out.mkdir(parents=True, exist_ok=True)
        except (ValueError, OSError) as error:
            fail(str(error))
        written = plot_counterfactual(results, out)
        for path in written:
            print(path)
        return written
    names = run_names(args.runs)
    out = args.out or default_out(args.runs, names)
    try:
        runs = [load_run(path, name) for path, name in zip(args.runs, names)]
    except (ValueError, OSError) as error:
        fail(str(error))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        fail(f"--out {out}: cannot create the folder ({error.strerror})")
    written = plot_runs(runs, out, args.smooth)
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
