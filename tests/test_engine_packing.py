"""Token-budget micro-batches (engine/packing.py, train.py --micro-batch-tokens): the packing's bounds, and in
float64 the update of packed micro-batches against one row per micro-batch, through train.py's own update."""

import dataclasses

import pytest
import torch
from test_train import recorded_update, sampled_step

import train
from conftest import assert_equal_to
from engine.packing import token_budget_micro_batches


def test_each_micro_batch_fits_the_budget_and_every_row_runs_once():
    lengths = torch.tensor([30, 5, 12, 70, 12, 8, 200, 1])
    rows = torch.arange(100, 108)
    batches = token_budget_micro_batches(rows, lengths, budget=64)
    assert sorted(torch.cat(batches).tolist()) == rows.tolist()
    by_row = dict(zip(rows.tolist(), lengths.tolist()))
    for batch in batches:
        longest = max(by_row[r] for r in batch.tolist())
        assert len(batch) == 1 or len(batch) * longest <= 64, batch
    assert [len(b) for b in batches] == [1, 1, 2, 4]  # 200 and 70 alone, then 30 with 12, then 12, 8, 5 and 1
    with pytest.raises(ValueError, match="budget"):
        token_budget_micro_batches(rows, lengths, 0)


def padded_tokens(out, rows: torch.Tensor) -> int:
    """The tokens a training pass over `rows` runs, every row whole: rows x (the longest prompt + the longest
    completion among them), read off the rollout's pad mask."""
    P = out.prompt_len
    return len(rows) * int(out.pad_mask[rows, :P].sum(1).max() + out.pad_mask[rows, P:].sum(1).max())


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_packed_micro_batches_give_the_update_of_one_row_each(
    tiny_model_dir, tmp_path, monkeypatch, varied_rewards, aggregation
):
    """In float64: two updates of 8 rows of different lengths, packed by --micro-batch-tokens into fewer
    micro-batches, each within the budget as the pass pads it, give the gradients, the weights after the
    updates and the metrics of 8 micro-batches of one row."""
    flags = ("--group-size", "4", "--max-new-tokens", "12", "--updates-per-rollout", "2", "--aggregation", aggregation)
    cfg, out, advantages = sampled_step(tiny_model_dir, tmp_path, monkeypatch, *flags)
    rows = len(out.pad_mask)
    per_row = recorded_update(dataclasses.replace(cfg, grad_accum=rows // 2), out, advantages, monkeypatch)
    budget = 3 * padded_tokens(out, torch.arange(rows))  # three rows of the longest prompt and completion
    passes, policy_inputs = [], train.policy_inputs

    def recorded(model, out, frozen, rows, cfg):
        passes.append(rows)
        return policy_inputs(model, out, frozen, rows, cfg)

    monkeypatch.setattr(train, "policy_inputs", recorded)
    packed = recorded_update(dataclasses.replace(cfg, micro_batch_tokens=budget), out, advantages, monkeypatch)
    assert sorted(torch.cat(passes).tolist()) == list(range(rows))  # every row once
    assert all(padded_tokens(out, rows) <= budget for rows in passes)
    assert len(passes) <= 2 * 3 < rows and len(packed["losses"]) == len(passes)
    assert per_row["metrics"]["micro_batches"] == rows // 2 and packed["metrics"]["micro_batches"] == len(passes) / 2
    assert len(packed["grads"]) == len(per_row["grads"]) == 2
    for got, expected in zip(packed["grads"], per_row["grads"]):
        assert expected.abs().max() > 1e-6  # a real gradient
        assert_equal_to(got, expected)
    for name, expected in per_row["weights"].items():
        assert_equal_to(packed["weights"][name], expected)
    for key, expected in per_row["metrics"].items():
        if key != "micro_batches" and not key.startswith("mismatch/"):  # mismatch/*: a diagnostic, not the update
            assert packed["metrics"][key] == pytest.approx(expected, rel=1e-9, abs=1e-12), key
