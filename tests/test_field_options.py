"""bench/field_options.py on a tiny random model, one step per setting: the plumbing the demo's timing runs
through (the settings' own runs swapped into one model, the laps and the mismatch's forward kept, the paired
fractions) and the fp32 / bf16 mismatch, so the bench is not what breaks when it is timed."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

import train


@pytest.fixture
def bench(monkeypatch):
    path = Path(train.__file__).parent / "bench" / "field_options.py"
    spec = importlib.util.spec_from_file_location("bench_field_options", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def tiny(model_dir: Path) -> dict:
    return {"model": str(model_dir), "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, "lora_rank": 4}


def test_the_cost_table_has_every_option_with_finite_fractions(bench, tiny_model_dir, one_thread):
    table = bench.step_costs(1, tiny(tiny_model_dir))
    assert list(table) == list(bench.SETTINGS)
    for name, row in table.items():
        fractions = [row["added_fraction"], row["added_fraction_min"], row["added_fraction_max"]]
        assert all(math.isfinite(f) for f in fractions), name
        assert row["step_seconds"] >= row["update_seconds"] >= row["mismatch_seconds"] > 0, name
    assert table["demo"]["added_fraction"] == 0.0
    assert table["dynamic-sampling 3"]["dynamic/calls"] == 3  # a random model's groups all score 0: every call
    rendered = bench.cost_table(table)
    assert all(f"| {name}" in rendered for name in bench.SETTINGS)


def test_the_mismatch_of_a_bf16_sampler_is_above_the_fp32_one(bench, tiny_model_dir, one_thread):
    table = bench.mismatch(1, 2, tiny(tiny_model_dir))
    fp32, bf16 = table["float32"], table["bfloat16"]
    assert fp32["mismatch/k3"] < 1e-6 and fp32["tis_weight_min"] == pytest.approx(1.0, abs=1e-3)
    assert bf16["mismatch/abs_mean"] > 10 * fp32["mismatch/abs_mean"]
