"""Experiment trackers: what train.py writes to metrics.jsonl, sent to TensorBoard, W&B or trackio as well.

    python train.py --log tensorboard                  # runs/NAME/tensorboard/; tensorboard --logdir runs
    WANDB_MODE=offline python train.py --log wandb     # runs/NAME/wandb/; `wandb sync` uploads it later
    python train.py --log tensorboard,wandb,trackio    # any subset; metrics.jsonl is always written

Every tracker gets the same scalars under the same names (metric_name: "train/reward", "clip/low_frac",
"perf/step_seconds", "eval/mean_at_k", ...), the run's settings, and the held-out results as a table.
A resumed run continues where it stopped: TensorBoard drops what the killed process logged after the
checkpoint (purge_step), W&B continues the same run (its id is kept in runs/NAME/wandb-id), trackio the
run of the same name in the project. Only the writing process (rank 0) logs. The trackers are optional
packages (requirements-loggers.txt), imported only when asked for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import re
from pathlib import Path

TRACKERS = ("tensorboard", "wandb", "trackio")
INSTALL = "pip install -r requirements-loggers.txt (make setup installs it)"

# metrics.jsonl key -> the name every tracker shows; keys not listed go under train/ (see metric_name)
NAMES = {
    "reward": "train/reward",
    "accuracy": "train/accuracy",
    "completion_length": "train/completion_length",
    "truncated": "train/truncated_frac",
    "entropy": "train/entropy",
    "clip_low_frac": "clip/low_frac",
    "clip_high_frac": "clip/high_frac",
    "limit_clip_frac": "clip/limit_frac",
    "ratio_min": "clip/ratio_min",
    "ratio_mean": "clip/ratio_mean",
    "ratio_max": "clip/ratio_max",
    "start_ratio_min": "clip/start_ratio_min",
    "start_ratio_max": "clip/start_ratio_max",
    "approx_kl": "kl/sampling_policy",
    "ref_kl": "kl/reference",
    "grad_norm": "optim/grad_norm",
    "skipped_updates": "optim/skipped_updates",
    "micro_batches": "perf/micro_batches",
    "step_seconds": "perf/step_seconds",
    "reward_seconds": "perf/reward_seconds",
    "rollout_tokens_per_s": "perf/rollout_tokens_per_s",
    "train_tokens_per_s": "perf/train_tokens_per_s",
}
BUCKET = re.compile(r"mu\[(.+)\]/(\w+)")  # loss.py's per-old-probability-bucket statistics
EVAL_NAMES = {"accuracy": "mean_at_k", "se": "mean_at_k_se", "pass@k": "pass_at_k"}
TABLE_COLUMNS = ["step", "when", "set", "problems", "k", "mean@k", "se", "pass@k"]


def parse(names: str) -> list[str]:
    return [name.strip() for name in names.split(",") if name.strip()]


def check(names: str) -> None:
    """A ValueError naming --log for an unknown tracker or one whose package is not installed."""
    for name in parse(names):
        if name not in TRACKERS:
            raise ValueError(
                f"--log {names}: unknown tracker {name!r}; known: {', '.join(TRACKERS)} "
                "(metrics.jsonl is always written)"
            )
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"--log {name}: the {name} package is not installed; {INSTALL}")


def metric_name(key: str) -> str:
    """The tracker name of a metrics.jsonl key: stable, and of the characters every tracker accepts
    (letters, digits, _ . - /): mu[<0.01]/clip_frac becomes clip_buckets/lt0.01/clip_frac."""
    if key in NAMES:
        return NAMES[key]
    if match := BUCKET.fullmatch(key):
        label = match[1].replace("<", "lt").replace(">", "gt")
        return f"clip_buckets/{label}/{match[2]}"
    name = key if key.startswith("rewards/") else f"train/{key}"
    return re.sub(r"[^\w./-]", "_", name)


def step_scalars(record: dict) -> dict[str, float]:
    """The numbers of one metrics.jsonl line under their tracker names (a null, an undefined value, is left out)."""
    return {
        metric_name(key): float(value)
        for key, value in record.items()
        if key not in ("step", "eval") and _number(value)
    }


def eval_scalars(result: dict) -> dict[str, float]:
    """A held-out result (eval.held_out) as scalars: eval/mean_at_k, and eval/SET/... for several sets."""
    scalars = {f"eval/{name}": float(result[key]) for key, name in EVAL_NAMES.items() if _number(result.get(key))}
    for set_name, part in result.get("sets", {}).items():
        scalars |= {
            f"eval/{set_name}/{name}": float(part[key]) for key, name in EVAL_NAMES.items() if _number(part.get(key))
        }
    return scalars


def eval_rows(result: dict, step: int, when: str, names: list[str]) -> list[list]:
    """The table rows of one evaluation: a row per held-out set, and their average when there are several."""
    parts = result.get("sets") or {names[0] if len(names) == 1 else "held-out": result}
    rows = [
        [step, when, name, part["problems"], part["k"], part["accuracy"], part["se"], part["pass@k"]]
        for name, part in parts.items()
    ]
    if "sets" in result:
        rows.append(
            [step, when, "average", result["problems"], result["k"], result["accuracy"], result["se"], result["pass@k"]]
        )
    return rows


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Loggers:
    """The trackers a run asked for; each call goes to all of them."""

    def __init__(
        self,
        names: str,
        run_dir: Path,
        settings: dict,
        settings_text: str,
        project: str,
        start_step: int,
        resumed: bool,
        eval_sets: list[str],
        earlier: list[tuple[dict, int, str]] = (),
    ):
        """earlier: the (result, step, when) of a resumed run's evaluations so far, for the results table."""
        self.eval_sets = eval_sets
        self.table = [row for result, step, when in earlier for row in eval_rows(result, step, when, eval_sets)]
        openers = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio}
        self.trackers = [
            openers[name](run_dir, settings, settings_text, project, start_step, resumed) for name in parse(names)
        ]

    def log_step(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.scalars(record["step"], step_scalars(record))
        if isinstance(record.get("eval"), dict):
            self.log_eval(record["eval"], record["step"], f"step {record['step']}")

    def log_eval(self, result: dict, step: int, when: str) -> None:
        """A held-out evaluation: its scalars at `step`, and the table of every evaluation so far."""
        self.table += eval_rows(result, step, when, self.eval_sets)
        for tracker in self.trackers:
            tracker.scalars(step, eval_scalars(result))
            tracker.results(step, self.table)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def _markdown(rows: list[list]) -> str:
    def cell(value):
        return f"{value:.4f}" if isinstance(value, float) else "" if value is None else str(value)

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


class _TensorBoard:
    """Event files in RUN/tensorboard: scalars, the settings and the results table as text."""

    def __init__(self, run_dir: Path, settings: dict, settings_text: str, project: str, start_step: int, resumed: bool):
        from torch.utils.tensorboard import SummaryWriter

        # on a resume, events a killed process wrote after the checkpoint are discarded by TensorBoard
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if resumed else None)
        indented = "\n".join("    " + line for line in settings_text.splitlines())  # a markdown code block
        self.writer.add_text("config", indented, global_step=start_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def results(self, step: int, rows: list[list]) -> None:
        self.writer.add_text("eval/results", _markdown(rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """A W&B run in RUN/wandb, its id in RUN/wandb-id so a resume continues it. Online or offline as W&B's
    own settings say (WANDB_MODE=offline: nothing leaves the machine until `wandb sync`)."""

    def __init__(self, run_dir: Path, settings: dict, settings_text: str, project: str, start_step: int, resumed: bool):
        import wandb

        id_file = run_dir / "wandb-id"
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
        try:
            self.run = wandb.init(
                project=project,
                name=run_dir.name,
                id=run_id,
                resume="allow" if run_id else None,
                dir=str(run_dir),
                config=settings,
                settings=wandb.Settings(console="off", silent=True, disable_git=True),
            )
        except Exception as error:  # no login, no network: say so in one line, before any step runs
            raise ValueError(
                f"--log wandb: W&B could not start a run ({type(error).__name__}: {error}); log in "
                "with `wandb login`, or set WANDB_MODE=offline"
            ) from None
        id_file.write_text(self.run.id)
        self.wandb = wandb

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def results(self, step: int, rows: list[list]) -> None:
        self.run.log({"eval/results": self.wandb.Table(columns=TABLE_COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    """A trackio run in its local database (TRACKIO_DIR, by default ~/.cache/huggingface/trackio), named as
    the run directory: `trackio show --project grpo` opens the dashboard."""

    def __init__(self, run_dir: Path, settings: dict, settings_text: str, project: str, start_step: int, resumed: bool):
        import trackio

        with contextlib.redirect_stdout(io.StringIO()):  # its banner, with terminal colours
            self.run = trackio.init(
                project=project,
                name=run_dir.name,
                config=settings,
                resume="allow" if resumed else "never",
                embed=False,
                auto_log_cpu=False,
            )
        self.trackio = trackio

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def results(self, step: int, rows: list[list]) -> None:
        self.run.log({"eval/results": self.trackio.Table(columns=TABLE_COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()  # also forgets the run, so trackio's exit hook does not finish it again
