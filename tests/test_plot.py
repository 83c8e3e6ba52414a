"""Tests for plot.py: the figures of short runs are real images, missing metrics are skipped, bad runs are one line."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from research import plot

BUCKETS = ("<0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">0.9")
# the keys a train.py step logs (read from a real 2-step run), without the bucket table
STEP_KEYS = (
    "reward",
    "accuracy",
    "completion_length",
    "truncated",
    "clip_low_frac",
    "clip_high_frac",
    "dual_clip_frac",
    "approx_kl",
    "ratio_min",
    "ratio_mean",
    "ratio_max",
    "entropy",
    "grad_norm",
    "skipped_updates",
    "step_seconds",
    "rollout_tokens_per_s",
    "reward_seconds",
    "train_tokens_per_s",
)
ALL_FIGURES = {
    "reward.png",
    "entropy.png",
    "length.png",
    "clipping.png",
    "kl.png",
    "grad_norm.png",
    "speed.png",
    "clip_buckets.png",
}


def write_run(
    path: Path, steps: int = 12, seed: int = 0, extra: tuple[str, ...] = (), keys=STEP_KEYS, summary: dict | None = None
) -> Path:
    """A run directory as train.py writes it, with random values under the real metric names."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {"step": step, **{key: float(rng.random()) for key in (*keys, *extra)}}
        if "approx_kl" in keys:
            record.update(
                {f"mu[{b}]/{stat}": float(rng.random()) for b in BUCKETS for stat in ("share", "adv_sign", "clip_frac")}
            )
        if step % 4 == 0:
            record["eval"] = {"accuracy": 0.5 + step / 40, "se": 0.05, "pass@k": 0.9, "problems": 72, "k": 8}
        lines.append(json.dumps(record))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = (
        {"before": {"accuracy": 0.5, "se": 0.05}, "after": {"accuracy": 0.8, "se": 0.04}}
        if summary is None
        else summary
    )
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def check_png(path: Path) -> None:
    """A non-trivial picture: a PNG of real size with many colours (lines, text, anti-aliasing)."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000, path
    pixels = matplotlib.image.imread(path)  # [H, W, 4]
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500, (path, pixels.shape)
    sample = pixels[::3, ::3].reshape(-1, pixels.shape[-1])  # every ninth pixel: enough to count colours, fast
    assert len(np.unique(sample, axis=0)) > 50, path


def test_figures_of_two_runs_overlaid(tmp_path, capsys):
    grpo = write_run(tmp_path / "grpo", seed=0)
    atr = write_run(tmp_path / "atr", seed=1, extra=("ref_kl", "limit_clip_frac"))
    out = tmp_path / "pictures"
    written = plot.main([str(grpo), str(atr), "--out", str(out), "--smooth", "3"])
    assert {path.name for path in written} == ALL_FIGURES
    assert capsys.readouterr().out.split() == [str(path) for path in written]
    for path in written:
        check_png(path)
    # several runs: colours are the runs, named by their directories
    runs = [plot.load_run(grpo, "grpo"), plot.load_run(atr, "atr")]
    assert plot._label(runs[0], "reward", runs, ["reward", "accuracy"]) == "grpo reward"
    assert plot._label(runs[1], "ref_kl", runs, ["ref_kl"]) == "atr"
    assert plot._label(runs[0], "entropy", runs[:1], ["entropy"]) == ""  # one line: no legend


def test_one_run_defaults_to_its_plots_folder_and_skips_missing_metrics(tmp_path, capsys):
    run = write_run(tmp_path / "bare", keys=("reward",), summary={})  # no eval entries either
    lines = (tmp_path / "bare" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "bare" / "metrics.jsonl").write_text(
        "\n".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "eval"}) for line in lines)
    )
    written = plot.main([str(run)])
    assert written == [run / "plots" / "reward.png"]
    check_png(written[0])


def test_held_out_points_join_summary_and_periodic_evaluations(tmp_path):
    run = plot.load_run(
        write_run(
            tmp_path / "r",
            steps=8,
            summary={"before": {"accuracy": 0.4, "se": None}, "after": {"accuracy": 0.9, "se": 0.1}},
        ),
        "r",
    )
    steps, accuracy, se = plot.held_out_points(run)
    assert steps.tolist() == [0, 4, 8, 8]
    assert accuracy.tolist() == pytest.approx([0.4, 0.6, 0.7, 0.9])
    assert se.tolist() == pytest.approx([0.0, 0.05, 0.05, 0.1])  # null se (one problem): no error bar


def test_a_resumed_run_counts_each_step_once_and_null_is_a_gap(tmp_path):
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    rows = [
        {"step": 1, "reward": 0.1},
        {"step": 2, "reward": 0.2},
        {"step": 2, "reward": 0.25},
        {"step": 3, "reward": None, "grad_norm": None},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    run = plot.load_run(run_dir, "resumed")
    steps, values = run.series("reward")
    assert steps.tolist() == [1, 2, 3] and values[:2].tolist() == [0.1, 0.25] and math.isnan(values[2])
    assert run.summary == {}


def test_trailing_mean_skips_missing_values():
    values = np.array([1.0, 3.0, np.nan, 5.0, np.nan, np.nan])
    smoothed = plot.trailing_mean(values, 2)
    assert smoothed[:4].tolist() == [1.0, 2.0, 3.0, 5.0] and smoothed[4] == 5.0 and math.isnan(smoothed[5])


def user_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        plot.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("plot.py: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_bad_run_directories_are_one_line(tmp_path, capsys):
    good = write_run(tmp_path / "good", steps=2)
    assert f"{tmp_path / 'nowhere'}: no such run directory" in user_error(
        [str(good), str(tmp_path / "nowhere")], capsys
    )
    (tmp_path / "empty").mkdir()
    assert "empty: no metrics.jsonl in it" in user_error([str(tmp_path / "empty")], capsys)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew\n')
    assert f"{broken / 'metrics.jsonl'}:2: invalid JSON" in user_error([str(broken)], capsys)
    (broken / "metrics.jsonl").write_text('{"reward": 0.5}\n')
    assert 'metrics.jsonl:1: expected a JSON object with an integer "step"' in user_error([str(broken)], capsys)
    assert "--smooth 0: must be >= 1" in user_error([str(good), "--smooth", "0"], capsys)
    blocker = tmp_path / "file.txt"
    blocker.write_text("")
    assert f"--out {blocker / 'plots'}: cannot create the folder" in user_error(
        [str(good), "--out", str(blocker / "plots")], capsys
    )
    assert not (good / "plots").exists()


def test_the_bucket_table_counts_region_and_limit_clips_together():
    record = {"mu[<0.01]/clip_frac": 0.25, "mu[<0.01]/limit_frac": 0.5, "mu[>0.9]/clip_frac": 0.125}
    assert plot.bucket_clipped(record, "<0.01") == 0.75 and plot.bucket_clipped(record, ">0.9") == 0.125
    assert math.isnan(plot.bucket_clipped(record, "0.1-0.5"))
    # a step that logged its clip rate (acting tokens after the first update) is drawn with it, not the older count
    honest = record | {"mu[<0.01]/clip_rate": 0.9, "mu[>0.9]/clip_rate": None}
    assert plot.bucket_clipped(honest, "<0.01") == 0.9 and math.isnan(plot.bucket_clipped(honest, ">0.9"))


def test_the_counterfactual_table_is_drawn_and_bad_directories_are_one_line(tmp_path, capsys):
    comparison = {
        "gap": 0.01,
        "se": 0.002,
        "n": 30,
        "t": 5.0,
        "p": 1e-5,
        "p_holm": 1e-4,
        "mde": 0.009,
        "called": True,
        "ci95": 0.004,
    }
    measures = {"kl": ["KL", 1000, 2], "clip": ["clipped %", 100, 1]}
    means = {
        arm: {
            "kl": [0.01, 0.001],
            "clip": [0.2, 0.01],
            **{f"clip[{b}]": [0.1 * i, 0.01] for i, b in enumerate(BUCKETS)},
        }
        for arm in ("grpo", "atr")
    }
    folder = tmp_path / "cf"
    folder.mkdir()
    (folder / "results.json").write_text(
        json.dumps({"measures": measures, "means": means, "gaps": {"atr": {"kl": comparison, "clip": comparison}}})
    )
    written = plot.main(["--counterfactual", str(folder)])
    assert [path.name for path in written] == ["gaps.png", "clip_buckets.png"]
    for path in written:
        assert path.parent == folder / "figures"
        check_png(path)
    assert "no results.json in it" in user_error(["--counterfactual", str(tmp_path)], capsys)
    assert "--counterfactual DIR alone" in user_error([str(folder), "--counterfactual", str(folder)], capsys)
    assert "--counterfactual DIR alone" in user_error([], capsys)


UNITS = ("nats", "tokens", "fraction", "seconds", "reward per completion", "no unit", "%")


def test_every_figure_is_fit_for_a_report(tmp_path):
    """Each figure rendered: every panel says what it counts and in which unit, shares never go below 0 (an
    all-zero panel included), Mean@k names its k, reward and accuracy have panels of their own, no grid slot is
    empty, one run's figures carry its name, and the clip table's numbers are printed at 11 pt."""
    run_dir = write_run(
        tmp_path / "demo-run", extra=("limit_clip_frac", "ref_kl", "rewards/math_reward", "rewards/brevity")
    )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({**line, "limit_clip_frac": 0.0}) + "\n" for line in lines)
    )  # a limit that never binds
    figures = plot.figures([plot.load_run(run_dir, "demo-run")])
    assert {f"{name}.png" for name in figures} == ALL_FIGURES
    for name, fig in figures.items():
        fig.canvas.draw()
        assert fig._suptitle is not None and fig._suptitle.get_text() == "demo-run" or name == "clip_buckets", name
        panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
        for ax in panels:
            title, ylabel = ax.get_title(), ax.get_ylabel()
            assert ax.has_data(), (name, title)  # no empty slot
            assert ylabel and (any(unit in ylabel for unit in UNITS) or name == "clip_buckets"), (name, title, ylabel)
            if "fraction" in ylabel or "Mean@" in ylabel:
                assert ax.get_ylim()[0] == 0.0 and ax.get_ylim()[1] <= 1.05, (name, title, ax.get_ylim())
        if name == "reward":
            titles = [ax.get_title() for ax in panels]
            assert titles == [
                "training reward",
                "training accuracy (the answer checker)",
                "reward of each function (--reward-fn)",
                "held-out accuracy (± se over problems)",
            ]
            assert panels[3].get_ylabel() == "Mean@8, fraction correct"
            assert [t.get_text() for t in panels[2].get_legend().get_texts()] == ["brevity", "math_reward"]
        if name == "clipping":
            assert panels[2].get_ylim() == (0.0, pytest.approx(0.055)), "all zero: from 0, not centred on it"
        if name == "clip_buckets":
            (ax,) = panels
            assert ax.get_title().startswith("demo-run: ") and ax.get_ylabel() == "old probability of the token"
            bar = next(a for a in fig.axes if a.get_label() == "<colorbar>")
            assert "%" in bar.get_ylabel()
            cells = [t for t in ax.texts]
            assert len(cells) == 5 * 12 and all(t.get_fontsize() >= 11 for t in cells)
            assert all(0 <= float(t.get_text()) <= 100 for t in cells), "percent, as the colour bar says"
        plot.plt.close(fig)


def test_every_axis_starts_at_zero_and_one_below_it_still_shows_zero(tmp_path):
    run_dir = write_run(tmp_path / "flat")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text(  # long completions that barely move, a slow step, a negative reward
        "".join(
            json.dumps({**line, "completion_length": 100 + line["step"] / 10, "step_seconds": 5.0, "reward": -0.5})
            + "\n"
            for line in lines
        )
    )
    figures = plot.figures([plot.load_run(run_dir, "flat")])
    for name in ("length", "speed", "entropy", "grad_norm", "kl"):
        for ax in figures[name].axes:
            assert ax.get_ylim()[0] == 0.0, (name, ax.get_title(), ax.get_ylim())
    reward = figures["reward"].axes[0]
    assert reward.get_ylim()[0] < 0.0 <= reward.get_ylim()[1] and reward.get_ylim()[0] >= -0.6
    for fig in figures.values():
        plot.plt.close(fig)


def test_the_bucket_cells_show_how_many_tokens_each_rate_is_over(tmp_path):
    run_dir = tmp_path / "rates"
    run_dir.mkdir()
    records = [
        {
            "step": step,
            **{f"mu[{b}]/clip_frac": 0.0 for b in BUCKETS},  # over every token, as train.py logs it too
            **{f"mu[{b}]/clip_rate": 1.0 if b == ">0.9" else 0.25 for b in BUCKETS},
            **{f"mu[{b}]/clip_rate_tokens": 1 if b == ">0.9" else 1000 for b in BUCKETS},
        }
        for step in (1, 2)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = plot.draw_bucket_table([plot.load_run(run_dir, "rates")])
    cells = [t.get_text() for t in table.axes[0].texts]
    assert "100.0\nn=1" in cells and "25.0\nn=1000" in cells, cells
    plot.plt.close(table)


def test_two_runs_of_one_name_get_two_legend_entries(tmp_path):
    first, second = write_run(tmp_path / "a" / "run", seed=0), write_run(tmp_path / "b" / "run", seed=1)
    assert plot.run_names([first, second]) == [str(first), str(second)]
    assert plot.run_names([first, first]) == [f"{first} #1", f"{first} #2"]
    names = plot.run_names([first, Path(str(first) + "/")])  # one directory, spelled twice
    runs = [plot.load_run(first, name) for name in names]
    figures = plot.figures(runs)
    legend = figures["entropy"].axes[0].get_legend()
    assert len({t.get_text() for t in legend.get_texts()}) == 2
    for fig in figures.values():
        plot.plt.close(fig)


def test_an_sft_run_draws_its_loss_and_the_figures_name_the_cap(tmp_path):
    run_dir = write_run(tmp_path / "sft", keys=("loss", "lr", "grad_norm", "step_seconds", "tokens_per_s"))
    (run_dir / "config.json").write_text(json.dumps({"max_new_tokens": 32, "batch_tokens": 4096}))
    figures = plot.figures([plot.load_run(run_dir, "sft")])
    assert "loss" in figures
    (ax,) = figures["loss"].axes
    assert ax.get_title() == "supervised loss (sft.py)" and "nats per reply token" in ax.get_ylabel()
    for fig in figures.values():
        plot.plt.close(fig)
    short, long = write_run(tmp_path / "short"), write_run(tmp_path / "long")
    (short / "config.json").write_text(json.dumps({"max_new_tokens": 16}))
    (long / "config.json").write_text(json.dumps({"max_new_tokens": 64}))
    figures = plot.figures([plot.load_run(short, "short"), plot.load_run(long, "long")])
    titles = [ax.get_title() for ax in figures["length"].axes]
    assert titles == [
        "completion length\n(--max-new-tokens 16 (short), 64 (long))",
        "truncated at the cap\n(--max-new-tokens 16 (short), 64 (long))",
    ]
    for fig in figures.values():
        plot.plt.close(fig)


def test_the_help_describes_the_figures_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        plot.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "clipping, KL, gradient norm and speed, fit for a report." in out
