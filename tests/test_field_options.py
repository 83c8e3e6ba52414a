"""bench/field_options.py's cost table on a tiny random model, one step per setting: the plumbing the demo's
timing runs through (the settings' own runs swapped into one model, the laps and the mismatch's forward kept,
the paired fractions), so the bench is not what breaks when it is timed."""

import importlib.util
import math
import sys
from pathlib import Path

import train


def test_the_cost_table_has_every_option_with_finite_fractions(tiny_model_dir, one_thread, monkeypatch):
    path = Path(train.__file__).parent / "bench" / "field_options.py"
    spec = importlib.util.spec_from_file_location("bench_field_options", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    base = {"model": str(tiny_model_dir), "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, "lora_rank": 4}
    table = bench.step_costs(1, base)
    assert list(table) == list(bench.SETTINGS)
    for name, row in table.items():
        fractions = [row["added_fraction"], row["added_fraction_min"], row["added_fraction_max"]]
        assert all(math.isfinite(f) for f in fractions), name
        assert row["step_seconds"] >= row["update_seconds"] >= row["mismatch_seconds"] > 0, name
    assert table["demo"]["added_fraction"] == 0.0
    assert table["dynamic-sampling 3"]["dynamic/calls"] == 3  # a random model's groups all score 0: every call
    rendered = bench.cost_table(table)
    assert all(f"| {name}" in rendered for name in bench.SETTINGS)
