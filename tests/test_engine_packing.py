"""Token-budget micro-batches (engine/packing.py): the packing's bounds, and in float64 the update of packed
micro-batches against one row per micro-batch, through train.py's own update."""

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


def packed_plan(budget: int):
    """train.micro_batch_plan with each mini-batch's rows packed by token budget (one process)."""
    plan = train.micro_batch_plan

    def micro_batch_plan(out, cfg, step, world, sharded):
        whole = plan(out, dataclasses.replace(cfg, grad_accum=1), step, world, sharded)
        lengths = out.pad_mask.sum(1)
        return [
            ([(rows, False) for rows in token_budget_micro_batches(mb[0][0], lengths[mb[0][0]], budget)], totals)
            for mb, totals in whole
        ]

    return micro_batch_plan


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_packed_micro_batches_give_the_update_of_one_row_each(tiny_model_dir, tmp_path, monkeypatch, aggregation):
    """In float64: two updates of 8 rows of different lengths, packed into fewer micro-batches by a token budget,
    give the gradients and metrics of 8 micro-batches of one row."""
    cfg, out, advantages = sampled_step(
        tiny_model_dir, tmp_path, monkeypatch, "--updates-per-rollout", "2", "--aggregation", aggregation
    )
    per_row = recorded_update(dataclasses.replace(cfg, grad_accum=len(out.pad_mask)), out, advantages, monkeypatch)
    budget = 3 * int(out.pad_mask.sum(1).max())
    monkeypatch.setattr(train, "micro_batch_plan", packed_plan(budget))
    packed = recorded_update(cfg, out, advantages, monkeypatch)
    assert len(packed["losses"]) < len(per_row["losses"])
    assert len(packed["grads"]) == len(per_row["grads"]) == 2
    for got, expected in zip(packed["grads"], per_row["grads"]):
        assert_equal_to(got, expected)
    for key, expected in per_row["metrics"].items():
        if key != "tokens" and not key.startswith("mismatch/"):  # mismatch/*: a diagnostic, not the update
            assert packed["metrics"][key] == pytest.approx(expected, rel=1e-9, abs=1e-12), key
