"""Training micro-batches packed by tokens instead of by rows (token_budget_micro_batches).

A training pass pads its rows to the longest among them, so a micro-batch costs rows x longest tokens.
Micro-batches of a fixed row count are sized for rows at full length, while most completions end far
earlier: packing rows by length up to a token budget runs the same rows in several times fewer passes.
The update is the same up to rounding: the loss's normalizers are the mini-batch's (train.py's totals),
so each row's term does not depend on which micro-batch it is in.
"""

from __future__ import annotations

import torch


def token_budget_micro_batches(rows: torch.Tensor, lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """rows [n] (row ids) with their pass lengths [n] (prompt + completion tokens) packed into micro-batches,
    each of rows whose count x longest length is at most `budget` tokens (a row longer than the budget runs
    alone). Longest first: each micro-batch takes the longest rows left, as many as its first one allows."""
    if budget < 1:
        raise ValueError(f"token_budget_micro_batches: budget must be >= 1 token, got {budget}")
    if rows.shape != lengths.shape:
        raise ValueError(f"token_budget_micro_batches: rows {tuple(rows.shape)} and lengths {tuple(lengths.shape)}")
    order = lengths.argsort(descending=True, stable=True)
    rows, sorted_lengths = rows[order], lengths[order].tolist()
    batches, lo = [], 0
    while lo < len(sorted_lengths):
        take = max(1, budget // max(1, sorted_lengths[lo]))  # the first row is the micro-batch's longest
        batches.append(rows[lo : lo + take])
        lo += take
    return batches
