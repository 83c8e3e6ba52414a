"""Tests for rollout.py on tiny random checkpoints: parity with transformers' greedy generate,
old_logp against a fresh forward pass, seeding and per-row random streams, the fixed-shape (CUDA)
loop against the eager one, small pools that preempt, split calls, the eager loop's copies by prompt
group, the prefill passes, graphs (a stand-in) reused across calls, host syncs and operator counts,
top-k/top-p sets, per-row stopping, bad input, and a CPU dry run of bench/gpu_check.py with its bytes
model and budget."""

import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lora
import rollout
import sampling
from conftest import make_tiny_checkpoint
from engine import kv_cache, sampler
from engine.graphs import EagerGraph
from engine.pool import Pool
from engine.scheduler import Group, Row, group_blocks
from infra.weights import load_checkpoint_dir

PROMPTS = [[5, 17, 42, 9], [100, 3, 77, 12, 250, 8, 61, 44, 19], [31]]  # different lengths: left padding


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_checkpoint_dir(tiny_model_dir)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_and_hf(request, tiny_model_dir, tmp_path_factory):
    import transformers

    family = request.param
    path = tiny_model_dir if family == "llama" else make_tiny_checkpoint(tmp_path_factory.mktemp(family), family)
    return load_checkpoint_dir(path), transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def sample(model, **overrides):
    kwargs = dict(samples_per_prompt=3, max_new_tokens=24, temperature=1.0, stop_ids=[], seed=0)
    kwargs.update(overrides)
    return rollout.generate(model, kwargs.pop("prompts", PROMPTS), **kwargs)


def hf_greedy(hf, prompt: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt, its stop token included."""
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids or None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers(model_and_hf):
    model, hf = model_and_hf
    # A stop id taken from prompt 0's own continuation, so rows end at different steps (or not at all).
    stop_ids = [hf_greedy(hf, PROMPTS[0], 16, [])[6]]
    expected = [hf_greedy(hf, p, 16, stop_ids) for p in PROMPTS]
    assert len({len(e) for e in expected}) > 1, "test setup: rows should stop at different steps"

    out = sample(model, samples_per_prompt=2, max_new_tokens=16, temperature=0.0, stop_ids=stop_ids)
    assert out.completions == [e for e in expected for _ in range(2)]
    assert out.finished.tolist() == [e[-1] in stop_ids for e in expected for _ in range(2)]


MANY_STOPS = list(range(3, 60))  # about a fifth of the tiny vocabulary: sampled rows end at scattered steps


def record_batches(monkeypatch) -> list:
    """The row counts of the device batches the loop builds (at every sync point that has rows running)."""
    sizes = []
    build = sampler.Loop._batch

    def recording(loop, *args):
        batch = build(loop, *args)
        sizes.append(len(batch.tokens))
        return batch

    monkeypatch.setattr(sampler.Loop, "_batch", recording)
    return sizes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fixed_shape_loop_matches_the_eager_loop(model, monkeypatch, temperature):
    stop_ids = MANY_STOPS
    if temperature == 0:  # greedy rows of a prompt are alike: stop prompts 0 and 1 early, prompt 2 late
        greedy = sample(model, samples_per_prompt=1, temperature=0.0).completion_ids
        stop_ids = [greedy[0, 4].item(), greedy[1, 9].item()]
    eager = sample(model, samples_per_prompt=4, temperature=temperature, stop_ids=stop_ids)
    lengths = eager.completion_mask.sum(1)
    assert lengths.min() < 12 and lengths.max() > 16, "test setup: rows should end at scattered steps"
    sizes = record_batches(monkeypatch)
    fixed = sample(model, samples_per_prompt=4, temperature=temperature, stop_ids=stop_ids, fixed_shapes=True)
    assert len(set(sizes)) > 1 and all(rows & (rows - 1) == 0 for rows in sizes), "row buckets are powers of two"
    assert fixed.completions == eager.completions
    torch.testing.assert_close(fixed.old_logp, eager.old_logp, rtol=0, atol=1e-5)


LONG_STOPS = [7, 99]  # rarely drawn: most rows run long, so a small pool runs out


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_preemption_and_pool_size_change_no_sample(model, fixed_shapes):
    """A pool of 4-slot blocks that holds one prompt's rows at full length but not all three prompts': groups
    are preempted and sampled again, and every token and old log-prob is the big pool's. The prompts'
    lengths (4, 9, 1) give a prompt filling its blocks, and prompts whose last block each row copies."""
    kwargs = dict(samples_per_prompt=4, max_new_tokens=40, stop_ids=LONG_STOPS, fixed_shapes=fixed_shapes)
    whole = sample(model, **kwargs)
    assert whole.stats.preempted == 0 and whole.stats.rows_max == 12
    blocks = 1 + group_blocks(9, 4, 40, 4) + 16  # the longest prompt's group, and some room
    small = sample(model, pool=Pool(model, blocks, block_size=4), **kwargs)
    assert small.stats.preempted > 0 if not fixed_shapes else small.stats.rows_max < 12
    assert small.completions == whole.completions
    torch.testing.assert_close(small.old_logp, whole.old_logp, rtol=0, atol=1e-5)
    logp, _ = model.token_logprobs(small.input_ids, small.pad_mask)
    torch.testing.assert_close(small.old_logp, logp[:, small.prompt_len :] * small.completion_mask, rtol=0, atol=1e-5)


def test_preempted_rows_restart_and_finished_ones_stay(model):
    """A small eager pool preempts groups some of whose rows already finished: only the unfinished rows are
    sampled again (fewer rows redone than preempted groups hold), and the result is the big pool's."""
    kwargs = dict(samples_per_prompt=4, max_new_tokens=40, stop_ids=[7, 99, 150, 21])
    whole = sample(model, **kwargs)
    small = sample(model, pool=Pool(model, 1 + group_blocks(9, 4, 40, 4), block_size=4), **kwargs)
    assert small.stats.preempted > 0 and small.completions == whole.completions
    torch.testing.assert_close(small.old_logp, whole.old_logp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_split_calls_give_the_samples_of_one_call(model, fixed_shapes):
    kwargs = dict(samples_per_prompt=2, stop_ids=MANY_STOPS, seed=5, fixed_shapes=fixed_shapes)
    whole = sample(model, **kwargs)
    for max_rows in (2, 5):  # one prompt in flight; two prompts (4 rows, whole prompts only)
        split = sample(model, max_rows=max_rows, **kwargs)
        assert split.stats.rows_max <= max_rows
        for field in ("completion_ids", "completion_mask", "input_ids", "pad_mask", "finished"):
            assert torch.equal(getattr(split, field), getattr(whole, field)), (max_rows, field)
        torch.testing.assert_close(split.old_logp, whole.old_logp, rtol=0, atol=1e-5)  # batch shape rounding
        assert split.prompt_len == whole.prompt_len and split.completions == whole.completions
    # A process that draws the last two prompts of the step samples what the one call did for them.
    tail = sample(model, prompts=PROMPTS[1:], first_prompt=1, **kwargs)
    assert tail.completions == whole.completions[2:]


def test_the_eager_loop_copies_each_prompts_blocks_once_a_step(model, monkeypatch):
    """Over 4-slot blocks (prompt 1's 9 tokens fill two blocks, prompt 0's 4 one, which their 3 rows share), every
    eager decode step's gather attention reads the rows by prompt group: a block held by several rows is copied
    once; the fixed-shape loop copies the rows one by one. The two loops' samples are the same."""
    steps = []
    init = kv_cache.DecodeAttention.__init__

    def recording(self, rows, span):
        init(self, rows, span)
        held = rows.table[rows.table > 0].tolist()
        steps.append((rows.groups is not None, self.gather.tolist(), {b for b in held if held.count(b) > 1}))

    monkeypatch.setattr(kv_cache.DecodeAttention, "__init__", recording)
    kwargs = dict(samples_per_prompt=3, max_new_tokens=12, stop_ids=LONG_STOPS)
    eager = sample(model, pool=Pool(model, 64, block_size=4), **kwargs)
    assert len(steps) == eager.stats.decode_steps and all(grouped for grouped, _, _ in steps)
    assert all(len(shared) == 3 and all(gather.count(b) == 1 for b in shared) for _, gather, shared in steps)
    steps.clear()
    fixed = sample(model, pool=Pool(model, 64, block_size=4), fixed_shapes=True, **kwargs)
    assert not any(grouped for grouped, _, _ in steps) and all(
        gather.count(b) == 3 for _, gather, s in steps for b in s
    )
    assert fixed.completions == eager.completions


def test_rows_of_lopsided_groups_are_copied_one_by_one():
    """Ten-block rows (two shared): two groups of four rows make key sequences of 2 + 4 x 8 blocks, 68 in all
    against 80 row by row, so attention copies by group; one group of four beside six groups of one would pad
    every sequence to 34 blocks, 238 against 100, so it copies the rows one by one."""
    fresh = iter(range(1, 1000))

    def group(prompt: int, members: int) -> Group:
        g = Group(prompt, 30, list(range(members)), shared=[next(fresh), next(fresh)])
        g.rows = [Row(g, m, 30, 1, g.shared + [next(fresh) for _ in range(8)]) for m in range(members)]
        return g

    balanced = [row for g in (group(0, 4), group(1, 4)) for row in g.rows]
    lopsided = [row for g in [group(0, 4)] + [group(i, 1) for i in range(1, 7)] for row in g.rows]
    groups = sampler.prompt_groups(balanced, torch.device("cpu"))
    assert groups is not None and groups.blocks.shape == (2, 34)
    assert sampler.prompt_groups(lopsided, torch.device("cpu")) is None


def test_prefill_passes_take_prompts_longest_first_and_pad_little():
    """The bench's eight prompt lengths make three passes whose padding stays within an eighth of their tokens
    (one pass would pad 225 of its 728 tokens); a pass holds at most PREFILL_TOKENS."""
    passes = sampler.prefill_batches([Group(i, n, [0]) for i, n in enumerate([69, 64, 91, 56, 44, 55, 45, 79])])
    assert [[g.prompt_len for g in part] for part in passes] == [[91, 79, 69], [64, 56, 55], [45, 44]]
    long = sampler.prefill_batches([Group(i, sampler.PREFILL_TOKENS // 2 - i, [0]) for i in range(3)])
    assert [[g.prompt for g in part] for part in long] == [[0, 1], [2]]


def test_prefill_passes_change_no_sample(model, monkeypatch):
    """PROMPTS (4, 9 and 1 tokens) prefill in three passes; with any padding allowed, in one: the same samples."""
    kwargs = dict(samples_per_prompt=2, stop_ids=MANY_STOPS, seed=1)
    split = sample(model, **kwargs)
    monkeypatch.setattr(sampler, "PREFILL_PADDING", 1.0)
    whole = sample(model, **kwargs)
    assert (split.stats.prefills, whole.stats.prefills) == (3, 1)
    assert split.completions == whole.completions
    torch.testing.assert_close(split.old_logp, whole.old_logp, rtol=0, atol=1e-5)


def test_seed_and_prompt_index_pick_the_stream(model):
    first = sample(model, seed=3)
    assert sample(model, seed=3, first_prompt=1).completions != first.completions
    assert (
        sample(model, prompts=PROMPTS[:1] * 2).completions[:3] != sample(model, prompts=PROMPTS[:1] * 2).completions[3:]
    )


def test_uniforms_are_uniform_and_independent_of_the_device_dtype_path():
    keys = sampling.row_keys(seed=2**40 + 7, first_prompt=3, prompts=64, G=16, device="cpu")
    u = torch.cat([sampling.uniform(keys[:-1], t) for t in range(8)])[:, 0]
    assert u.min() > 0 and u.max() <= 1 and len(u.unique()) > 0.99 * len(u)
    assert abs(u.mean().item() - 0.5) < 0.01 and abs((u < 0.1).float().mean().item() - 0.1) < 0.01
    # the tensor hash equals the same arithmetic on Python integers (no int64 overflow anywhere)
    assert sampling.mix32(torch.tensor([0, 1, 2**32 - 1])).tolist() == [sampling.mix32(x) for x in (0, 1, 2**32 - 1)]
    positions = torch.arange(8).repeat_interleave(len(keys) - 1)  # per-row positions: the same uniforms
    assert torch.equal(sampling.uniform(keys[:-1].repeat(8), positions)[:, 0], u)


def test_graphs_are_captured_once_per_shape_and_reused_across_calls(model):
    """EagerGraph stands in for CUDA graphs: the loop reads its rows and logits from the static buffers the
    graphs read, and the pool keeps the graphs, so a second call of the same shapes captures none."""
    pool = Pool(model, 400, block_size=4, graph_class=EagerGraph)
    kwargs = dict(samples_per_prompt=4, stop_ids=MANY_STOPS, fixed_shapes=True)
    expected = sample(model, cuda_graphs="off", **kwargs)
    first = sample(model, pool=pool, cuda_graphs="on", **kwargs)
    assert first.stats.captures == len(pool.graphs.captured) > 1
    again = sample(model, pool=pool, cuda_graphs="on", **kwargs)
    other_seed = sample(model, pool=pool, cuda_graphs="auto", seed=1, **kwargs)
    assert again.stats.captures == 0 and other_seed.stats.captures < first.stats.captures
    for out in (first, again):
        assert out.completions == expected.completions
        torch.testing.assert_close(out.old_logp, expected.old_logp, rtol=0, atol=1e-5)
    assert other_seed.completions == sample(model, cuda_graphs="off", seed=1, **kwargs).completions


def test_new_adapters_rebuild_the_decode_weights_and_drop_the_graphs(tiny_model_dir):
    """A pool's decode weights follow the adapters: new values are copied in place (the graphs stay), and
    adapters added since make new buffers and new graphs; either way the samples are the model's."""
    import lora

    model = load_checkpoint_dir(tiny_model_dir)
    pool = Pool(model, 400, block_size=4, graph_class=EagerGraph)
    kwargs = dict(samples_per_prompt=2, stop_ids=MANY_STOPS, fixed_shapes=True, cuda_graphs="on")
    sample(model, pool=pool, **kwargs)
    lora.inject(model, rank=2, alpha=4.0)
    for step in range(2):
        with torch.no_grad():
            for p in lora.parameters(model):
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel() + step))
        out = sample(model, pool=pool, **kwargs)
        assert (out.stats.captures > 0) == (step == 0)
        logp, _ = model.token_logprobs(out.input_ids, out.pad_mask)
        torch.testing.assert_close(out.old_logp, logp[:, out.prompt_len :] * out.completion_mask, rtol=0, atol=1e-5)


HOST_SYNCS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.equal.default",
    "aten.is_nonzero.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.repeat_interleave.Tensor",
    "aten.item.default",
}


class CountHostSyncs(TorchDispatchMode):
    """Operators that make the host wait for a CUDA device: a scalar read, a data-dependent shape (nonzero,
    boolean indexing, unique, ...) or a copy to the host (the decode loop's _to_host, a device="cpu" copy)."""

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        to_host = func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu")
        if str(func) in HOST_SYNCS or boolean_index or to_host:
            self.syncs.append(str(func))
        return func(*args, **kwargs)


def test_the_fixed_shape_loop_syncs_the_host_once_every_16_steps(model):
    with CountHostSyncs() as counter:
        out = sample(model, samples_per_prompt=4, max_new_tokens=96, stop_ids=LONG_STOPS, fixed_shapes=True)
    steps = out.stats.decode_steps
    assert steps >= 4 * sampler.SYNC_EVERY
    # one read of the finished flags per chunk of SYNC_EVERY steps, and the last one, which finds none running
    assert len(counter.syncs) <= steps / sampler.SYNC_EVERY + 1, counter.syncs


def test_plan_simulation_takes_the_samplers_decisions(model, monkeypatch):
    """memory.simulate_rollout, given the lengths the sampler's rows end at, counts the decode steps, rows in
    flight, prefills and preemptions of the real fixed-shape loop on a small pool."""
    from engine import memory

    C, G = 48, 4
    lengths = [40, 38, 36, 34, 39, 37, 35, 33, 12, 9, 20, 5]  # prompts 0 and 1 run long: one is preempted
    stop = model.config.vocab_size - 1
    draw = sampling.draw
    stop_at = torch.tensor(lengths + [0])

    def forcing_draw(logits, *, rows, position, **kw):
        tokens, logp = draw(logits, rows=rows, position=position, **kw)
        return tokens.masked_fill(stop_at[rows] == position + 1, stop), logp

    monkeypatch.setattr(sampling, "draw", forcing_draw)
    blocks = 1 + group_blocks(9, G, C, 4) + 24
    out = sample(
        model,
        samples_per_prompt=G,
        max_new_tokens=C,
        stop_ids=[stop],
        fixed_shapes=True,
        pool=Pool(model, blocks, block_size=4),
    )
    ended = out.completion_mask.sum(1).tolist()  # the forced lengths, or earlier where the model drew the stop
    assert all(n <= cap for n, cap in zip(ended, lengths)) and sum(ended) > 250
    simulated = memory.simulate_rollout([len(p) for p in PROMPTS], G, ended, blocks, 4, len(PROMPTS) * G, C)
    assert out.stats.preempted > 0
    for name in ("decode_steps", "rows_max", "row_steps", "preempted", "prefills"):
        assert getattr(simulated, name) == getattr(out.stats, name), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_matches_the_eager_fixed_shape_loop(tiny_model_dir):
    gpu = load_checkpoint_dir(tiny_model_dir, device="cuda")
    for temperature in (0.0, 1.0):
        kwargs = dict(samples_per_prompt=4, temperature=temperature, stop_ids=MANY_STOPS, fixed_shapes=True)
        graphed, eager = sample(gpu, cuda_graphs="on", **kwargs), sample(gpu, cuda_graphs="off", **kwargs)
        assert graphed.completions == eager.completions
        torch.testing.assert_close(graphed.old_logp, eager.old_logp, rtol=0, atol=1e-5)


def test_a_failed_capture_warns_and_decodes_eagerly_unless_graphs_are_required(model, monkeypatch):
    expected = sample(model, samples_per_prompt=4, stop_ids=MANY_STOPS, fixed_shapes=True)

    def failing_capture(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(EagerGraph, "capture", failing_capture)
    for required in (False, True):
        pool = Pool(model, 400, block_size=4, graph_class=EagerGraph)
        if required:
            with pytest.raises(RuntimeError, match="stream is capturing"):
                sample(model, samples_per_prompt=4, stop_ids=MANY_STOPS, fixed_shapes=True, pool=pool, cuda_graphs="on")
        else:
            with pytest.warns(UserWarning, match="decoding without graphs") as caught:
                out = sample(model, samples_per_prompt=4, stop_ids=MANY_STOPS, fixed_shapes=True, pool=pool)
            assert len(caught) == 1 and out.completions == expected.completions
            assert pool.graphs.failed  # the pool's later calls do not try again


def test_no_tensor_is_made_off_the_models_device(model):
    # Under a meta default device, a tensor created without device= lands on meta, and mixing it with
    # the CPU model's tensors raises, as a CPU tensor mixed with CUDA ones does.
    expected = sample(model, samples_per_prompt=4, stop_ids=MANY_STOPS)
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        runs = [
            sample(model, samples_per_prompt=4, stop_ids=MANY_STOPS, **extra)
            for extra in (
                {},
                {"fixed_shapes": True},
                {"max_rows": 4},
                {"pool": Pool(model, 40, block_size=4, graph_class=EagerGraph), "fixed_shapes": True},
            )
        ]
    finally:
        torch.set_default_device(previous)
    for out in runs:
        assert out.completions == expected.completions and out.input_ids.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA-graph decode step needs a CUDA device")
def test_cuda_graph_sampler_matches_cpu_and_fresh_forward(model, tiny_model_dir):
    gpu = load_checkpoint_dir(tiny_model_dir, device="cuda")
    stop_ids = [7, 21, 99]
    on_gpu, on_cpu = sample(gpu, temperature=0.0, stop_ids=stop_ids), sample(model, temperature=0.0, stop_ids=stop_ids)
    assert on_gpu.completions == on_cpu.completions
    torch.testing.assert_close(on_gpu.old_logp.cpu(), on_cpu.old_logp, rtol=0, atol=1e-4)
    out = sample(gpu, temperature=1.0, stop_ids=stop_ids)
    with torch.no_grad():
        logp, _ = gpu.token_logprobs(out.input_ids, out.pad_mask)
    torch.testing.assert_close(out.old_logp, logp[:, out.prompt_len :] * out.completion_mask, rtol=0, atol=1e-4)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.3, 0, 0.8), (0.0, 0, 1.0)])
def test_old_logp_equals_fresh_forward(model, temperature, top_k, top_p):
    out = sample(model, temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=[7, 21, 99, 150])
    assert not out.completion_mask.all(), "test setup: some rows should stop early"
    logp, _ = model.token_logprobs(out.input_ids, out.pad_mask, temperature=temperature or 1.0)
    expected = logp[:, out.prompt_len :] * out.completion_mask
    torch.testing.assert_close(out.old_logp, expected, rtol=0, atol=1e-5)


def test_rows_that_stop_at_once_leave_before_the_first_decode_step(model):
    # Prompt 1's greedy rows stop on their first token, drawn from the prefill's logits: they leave at the
    # first sync, and their blocks go back, before any decode step.
    first_token = sample(model, temperature=0.0, max_new_tokens=1).completion_ids[3, 0].item()
    out = sample(model, temperature=0.0, max_new_tokens=6, stop_ids=[first_token])
    lengths = [len(c) for c in out.completions]
    assert lengths[3:6] == [1, 1, 1] and max(lengths) == 6
    logp, _ = model.token_logprobs(out.input_ids, out.pad_mask)
    torch.testing.assert_close(out.old_logp, logp[:, out.prompt_len :] * out.completion_mask, rtol=0, atol=1e-5)


def test_seeded_sampling_is_reproducible(model):
    first, again, other = sample(model, seed=3), sample(model, seed=3), sample(model, seed=4)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert torch.equal(first.old_logp, again.old_logp)
    assert not torch.equal(first.completion_ids, other.completion_ids)


def test_narrow_top_k_and_top_p_are_greedy(model):
    greedy = sample(model, temperature=0.0).completions
    assert sample(model, temperature=1.5, top_k=1, seed=1).completions == greedy
    assert sample(model, temperature=1.5, top_p=1e-4, seed=2).completions == greedy


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.5), (40, 0.6)])
def test_samples_stay_inside_top_k_top_p_set(model, top_k, top_p):
    temperature = 1.2
    out = sample(model, samples_per_prompt=8, max_new_tokens=32, temperature=temperature, top_k=top_k, top_p=top_p)
    P = out.prompt_len
    with torch.no_grad():
        logits = (
            model(out.input_ids, out.pad_mask)[:, P - 1 : -1].float() / temperature
        )  # predicts each completion token
    sorted_logits, order = logits.sort(-1, descending=True)
    rank = (order == out.completion_ids[..., None]).float().argmax(-1)  # [N, C] rank of the sampled token
    k = top_k or logits.shape[-1]
    probs = sorted_logits[..., :k].softmax(-1)  # renormalized over the top-k, as top-p sees them
    mass_before = (probs.cumsum(-1) - probs).gather(-1, rank.clamp(max=k - 1)[..., None])[..., 0]
    assert (rank < k).all()
    assert (mass_before < top_p + 1e-5).all()
    assert len(out.completion_ids.unique()) > 10, "test setup: sampling should not collapse to a few tokens"


def test_rows_stop_at_their_own_stop_token(model, tiny_model_dir):
    from transformers import AutoTokenizer

    stop_ids = [2, 7, 21, 99, 150]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = sample(model, samples_per_prompt=6, max_new_tokens=30, stop_ids=stop_ids, tokenizer=tokenizer)
    N, C = out.completion_ids.shape
    assert N == len(PROMPTS) * 6 and C == 30
    assert out.finished.any() and out.truncated.any(), "test setup: want finished and truncated rows"
    for i, completion in enumerate(out.completions):
        n = len(completion)
        first_stop = next((j for j, token in enumerate(completion) if token in stop_ids), None)
        assert out.finished[i] == (first_stop is not None) != out.truncated[i]
        assert first_stop == n - 1 if out.finished[i] else n == C
        assert out.completion_mask[i].tolist() == [True] * n + [False] * (C - n)
        assert out.completion_ids[i, :n].tolist() == completion and (out.completion_ids[i, n:] == 0).all()
        assert (out.old_logp[i, n:] == 0).all() and (out.old_logp[i, :n] < 0).all()
        prompt = PROMPTS[i // 6]
        assert out.input_ids[i, out.prompt_len - len(prompt) :].tolist() == prompt + out.completion_ids[i].tolist()
        assert (
            out.pad_mask[i].tolist()
            == [False] * (out.prompt_len - len(prompt)) + [True] * len(prompt) + out.completion_mask[i].tolist()
        )
        assert out.texts[i] == tokenizer.decode(completion, skip_special_tokens=True)


def test_all_rows_truncated(model):
    out = sample(model, max_new_tokens=4)
    assert out.truncated.all() and not out.finished.any()
    assert [len(c) for c in out.completions] == [4] * len(PROMPTS) * 3


def test_results_can_enter_autograd(model):
    out = sample(model, max_new_tokens=4)
    weight = torch.ones(out.old_logp.shape, requires_grad=True)
    ((weight * out.old_logp) * out.completion_mask).sum().backward()  # inference tensors would refuse this
    assert torch.equal(weight.grad, out.old_logp * out.completion_mask)


@pytest.mark.parametrize(
    "overrides, argument",
    [
        (dict(prompts=[]), "prompts"),
        (dict(prompts=[[1, 2], []]), r"prompts\[1\]"),
        (dict(prompts=[[1] * 257]), r"prompts\[0\]"),
        (dict(prompts=[[1, 300]]), r"prompts\[0\]"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[1] * 250], max_new_tokens=10), "max_new_tokens"),
        (dict(samples_per_prompt=0), "samples_per_prompt"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_rows=2), "max_rows"),
        (dict(first_prompt=-1), "first_prompt"),
        (dict(cuda_graphs="maybe"), "cuda_graphs"),
        (dict(cuda_graphs="on"), "cuda_graphs='on' needs the model on a CUDA device"),
        (dict(pool="small"), "pool: 5 blocks of 4 slots hold no group of 3 samples of the longest prompt"),
        (dict(pool="other model"), "pool: it was built for another model"),
    ],
)
def test_bad_input_names_the_argument(model, tiny_model_dir, overrides, argument):
    if overrides.get("pool") == "small":
        overrides["pool"] = Pool(model, 6, block_size=4)
    elif overrides.get("pool") == "other model":
        overrides["pool"] = Pool(load_checkpoint_dir(tiny_model_dir), 400)
    with pytest.raises(ValueError, match=argument):
        sample(model, **overrides)


def test_out_of_memory_names_the_knobs(model, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kv_cache.KVPool, "__init__", no_memory)
    with pytest.raises(torch.OutOfMemoryError, match="3 prompts x 3 samples x 24 new tokens.*max_rows"):
        sample(model)


def bench_gpu_check():
    """bench/gpu_check.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_gpu_check", Path(__file__).parent.parent / "bench" / "gpu_check.py"
    )
    gpu_check = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ):  # it sets the CUDA allocator's mode, which this process's children inherit
        spec.loader.exec_module(gpu_check)
    return gpu_check


def test_gpu_check_dry_run(tmp_path, capsys):
    """bench/gpu_check.py end to end on a tiny Qwen3 on the CPU, so the script is not what breaks on a GPU: the
    branches the GPU run takes (graphs, through their stand-in; the anchor's compile warm-up; LoRA adapters; the
    presets' plans run at their sizes; train.py as a subprocess), the JSON written after every row, and, in a
    second run, the budget cut."""
    script = [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tiny"]
    run = subprocess.run(
        [*script, "--out", str(tmp_path / "full")],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "full" / "gpu_check.json").read_text())
    assert report["ok"] and report["skipped"] == 0 and report["models"]["Qwen3-tiny"]["parity"]["ok"]
    assert report["models"]["Qwen3-tiny"]["parity"]["t=0"]["captures"] > 0, "the graphs' stand-in captured"
    assert all(row["status"] == "ok" for row in report["rows"])
    phases = {(row["side"], row["phase"]) for row in report["rows"]}
    timed = {(row["side"], row["phase"]) for row in report["rows"] if row["tokens_per_s"]}
    for cap in (8, 16):
        assert ("ours", f"rollout 2x2 rows, cap {cap}, warm-up (graph captures)") in phases
        assert ("transformers", f"rollout 2x2 rows, cap {cap}, warm-up (compile)") in phases
        for side in ("ours", "transformers"):
            assert (side, f"rollout 2x2 rows, cap {cap}, forced") in timed, (side, cap)
            assert any(s == side and f"cap {cap}, long tail" in phase for s, phase in timed), (side, cap)
    assert all(
        row["planned_peak_bytes"] for row in report["rows"] if row["side"] == "ours" and "forced" in row["phase"]
    )
    assert {side for side, phase in timed if phase.startswith("train")} == {"ours", "transformers + peft"}
    assert "peak GiB" in run.stdout and "ok (0 runs skipped" in run.stdout

    # the roofline: the CPU has no datasheet figure, so the copy's bandwidth stands in
    assert (
        report["bandwidth"]["copy_gbps"] > 0
        and report["bandwidth"]["roofline_gbps"] == report["bandwidth"]["copy_gbps"]
    )
    rows = {row["phase"]: row for row in report["rows"]}
    roofline = [rows["decode 1 rows x 32 context"], rows["decode 4 rows x 64 context"]]
    roofline += [row for row in report["rows"] if "forced" in row["phase"] and row["phase"].startswith("rollout")]
    for row in roofline:
        assert row["roofline_ms"] == pytest.approx(row["step_bytes"] / (report["bandwidth"]["roofline_gbps"] * 1e6))
        assert row["of_roofline"] == pytest.approx(row["roofline_ms"] / row["ms_per_step"])
    # every LoRA preset planned; those with a plan of their own ran it phase by phase, against the plan
    presets = report["presets"]
    assert presets["gppo-qwen3-8b-full"] == {"left_out": "full-parameter, planned per rank of 8 (bench/full_step.py)"}
    ran = {preset for preset, result in presets.items() if "outside_allocator_bytes" in result}
    planned = {preset for preset, result in presets.items() if "planned_peak_bytes" in result}
    gpu_check = bench_gpu_check()
    assert planned == set(gpu_check.presets_to_check()[0]) and ran
    assert all(presets[p].get("same_plan_as") in ran for p in planned - ran)
    for preset in ran:
        runs = [row for row in report["rows"] if row["phase"].startswith(f"{preset}: ")]
        assert [row.get("plan_phase") for row in runs] == [
            None,  # the plan
            "weights",
            "lora",
            "pool",
            "train",
            "rollout",
            "eval",
        ], "fp32 recomputes no old log-probs: no frozen passes"
        assert all(row["planned_peak_bytes"] > 0 and row["budget_bytes"] == 1.125e9 for row in runs[1:])
    assert report["train_run"]["exit_status"] == 0 and report["train_run"]["steps"] == 2
    assert (tmp_path / "full" / "train_run.log").read_text().count("step 2/2") == 1

    # the budget cut through the same main() in this process
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "cut"), "--budget-s", "0.01"]) == 0
    report = json.loads((tmp_path / "cut" / "gpu_check.json").read_text())
    statuses = [row["status"] for row in report["rows"]]
    # whether the first row (the bandwidth) starts within 0.01 s depends on the machine; what follows never fits
    assert statuses[-1].startswith("skipped: budget") and "runs skipped for the budget" in capsys.readouterr().out
    assert all(s.startswith("skipped: budget") for s in statuses[1:]), statuses


def test_gpu_check_decode_bytes_against_a_hand_count_and_the_tensors_a_step_reads():
    """decode_step_bytes, part by part, against a count by hand for the tiny Qwen3 and against the tensors a
    decode step reads, on meta: the model's weights (lm_head once, the embedding's rows), the decode weights'
    q/k norms and adapters (B over all of its group's outputs), the pool's slots, tied and untied."""
    from engine.decode_weights import DecodeWeights
    from engine.kv_cache import KVPool
    from model import ModelConfig, Transformer

    gpu_check = bench_gpu_check()
    cfg = ModelConfig.from_hf({**gpu_check.QWEN3_COMMON, **gpu_check.QWEN3_TINY["Qwen3-tiny"]})
    got = gpu_check.decode_step_bytes(cfg, rows=3, context=32, dtype=torch.bfloat16, lora_rank=2)
    # hidden 64, intermediate 128, 2 layers, 4 heads and 2 kv heads of 16, vocabulary 512; 2 bytes an element
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 64 * 128 + 128 * 64  # q; k, v; o; gate, up; down
    layer += 2 * 64 + (4 + 2) * 16  # the two RMSNorms; q_norm per query head and k_norm per kv head
    assert got["weights"] == 2 * (2 * layer + 64 + 512 * 64 + 3 * 64)  # final norm, lm_head, 3 rows' embeddings
    # A [in, r per adapter] and B [r per adapter, the group's outputs]: qkv, o, gate + up, down
    adapters = (64 * 6 + 6 * 128) + (64 * 2 + 2 * 64) + (64 * 4 + 4 * 256) + (128 * 2 + 2 * 64)
    assert got["adapters"] == 2 * 2 * adapters
    token = 2 * 2 * 2 * 16  # a token's keys and values: layers x (k, v) x kv heads x head_dim
    assert got["kv_read"] == 2 * 3 * 32 * token and got["kv_write"] == 2 * 3 * token
    assert got["logits"] == 2 * 3 * 512

    for tied, targets in ((True, lora.DEFAULT_TARGETS), (False, ("q_proj", "v_proj"))):
        shape = dataclasses.replace(cfg, tie_word_embeddings=tied)
        with torch.device("meta"):
            model = Transformer(shape).to(torch.bfloat16)
        lora.inject(model, 2, 4.0, targets)
        weights = DecodeWeights(model)
        base = [
            p
            for name, p in model.named_parameters()
            if ".lora_" not in name and not name.endswith(("q_norm.weight", "k_norm.weight"))
        ]
        read = sum(p.nbytes for p in base) + sum(t.nbytes for t in weights.qk_norms) + 3 * 64 * 2
        read -= 0 if tied else model.model.embed_tokens.weight.nbytes  # untied: only the rows' embeddings
        got = gpu_check.decode_step_bytes(shape, 3, 32, torch.bfloat16, 2, targets)
        assert got["weights"] == read, tied
        assert got["adapters"] == sum(g.A.nbytes + g.B.nbytes for g in weights.groups if g.A is not None), targets
        slot = KVPool.block_bytes(shape, 16, torch.bfloat16) // 16
        assert (got["kv_read"], got["kv_write"], got["logits"]) == (3 * 32 * slot, 3 * slot, 3 * 512 * 2)


def test_gpu_check_budget_skips_what_cannot_end_in_time_on_a_fake_clock(tmp_path, monkeypatch):
    """The check's budget with a clock that advances only by what each run takes: a kind's first run is
    estimated by its first_s (a compile warm-up longer than the budget never starts), later runs by the
    slowest rate of their kind so far; a run that would end past the budget is skipped, and the next one that
    fits still runs. Every row is in the JSON, with its reserved peak field."""
    gpu_check = bench_gpu_check()
    now = [0.0]

    def taking(seconds: float):
        def run():
            now[0] += seconds
            return seconds

        return run

    check = gpu_check.Check(torch.device("cpu"), {}, tmp_path / "check.json", budget_s=100, clock=lambda: now[0])
    check.run("m", "warm-up (compile)", "transformers", taking(50), ours=False, work=1, kind="compile", first_s=120)
    check.run("m", "a", "ours", taking(30), work=10, kind="decode")  # the first of its kind: 3 s per unit
    check.run("m", "b", "ours", taking(30), work=30, kind="decode")  # 30 s spent + 90 s estimated > 100
    check.run("m", "c", "ours", taking(30), work=20, kind="decode")  # 30 + 60 <= 100: runs
    check.run("m", "d", "ours", taking(1), work=1, kind="decode")  # 60 + 3 <= 100: runs
    statuses = [row["status"].split(":")[0] for row in check.rows]
    assert statuses == ["skipped", "ok", "skipped", "ok", "ok"], check.rows
    assert now[0] == 61 and not check.failed
    rows = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert len(rows) == 5 and all("peak_reserved_bytes" in row for row in rows)


def test_gpu_check_budget_of_the_new_kinds_on_a_fake_clock(tmp_path, monkeypatch):
    """The new kinds within the check's budget, on a clock that stands still unless a run moves it: a plan and the
    train.py run need their first estimates (PLAN_S, TRAIN_RUN_S) left, or they never start; a preset whose phase is
    skipped runs none after it; decode steps are estimated by the bytes they move, so after a first shape's rate a
    larger one may be skipped where a smaller one still runs."""
    gpu_check = bench_gpu_check()
    now = [0.0]
    check = gpu_check.Check(torch.device("cpu"), {}, tmp_path / "check.json", budget_s=100, clock=lambda: now[0])

    def never(*args, **kwargs):
        raise AssertionError("started without the budget for it")

    monkeypatch.setattr(gpu_check, "plan_preset", never)
    monkeypatch.setattr(gpu_check, "train_run", never)
    now[0] = 101 - gpu_check.PLAN_S  # a second short of a first plan's estimate
    assert gpu_check.check_presets(check, {"atr-grpo-qwen3-1.7b": "Qwen3-1.7B"}, tiny=True) == {}
    assert gpu_check.check_train_run(check, tmp_path, tiny=True) is None and gpu_check.TRAIN_RUN_S > 100
    assert [row["status"].split(":")[0] for row in check.rows] == ["skipped", "skipped"]

    # the weights phase takes all the budget left: the phases after it are not started
    hf, ours = gpu_check.bench_rollout.build_qwen3("Qwen3-tiny", "cpu")
    work = gpu_check.memory.Workload(dtype=torch.float32, lora_rank=2, max_new_tokens=8, prompt_len=8, pool_blocks=4)
    plan = gpu_check.PresetPlan(work, dict.fromkeys(gpu_check.memory.phase_sizes(work), 1), 10**9)

    def slow_model(*args):
        now[0] = 100.5
        return ours

    monkeypatch.setattr(gpu_check, "random_model", slow_model)
    check.rows.clear()
    now[0] = 0.0
    gpu_check.check_preset(check, "Qwen3-tiny", "p", ours.config, plan)
    assert [(row.get("plan_phase"), row["status"].split(":")[0]) for row in check.rows] == [
        ("weights", "ok"),
        (None, "skipped"),
    ]

    # decode: a first timed shape sets the rate; the budget left holds the smaller shape's bytes, not the larger's
    gpu_check.with_adapters(ours)
    small, large = (
        sum(gpu_check.decode_step_bytes(ours.config, rows, context, ours.dtype, gpu_check.bench_model.RANK).values())
        for rows, context in gpu_check.DECODE_SHAPES_TINY
    )
    assert large > small

    def ticking() -> float:  # a microsecond a reading, so that real runs take some time
        now[0] += 1e-6
        return now[0]

    now[0] = 0.0
    check = gpu_check.Check(torch.device("cpu"), {}, tmp_path / "decode.json", budget_s=100, clock=ticking)

    def one_second():
        now[0] += 1.0

    check.run("Qwen3-tiny", "a first decode", "ours", one_second, work=small * 3, kind="Qwen3-tiny decode")
    now[0] = 100 - (1 + large / small) / 2  # more than the small shape's second, less than the large one's
    gpu_check.check_decode(check, "Qwen3-tiny", ours, tiny=True)
    statuses = {row["phase"]: row["status"].split(":")[0] for row in check.rows[1:]}
    assert statuses == {
        "decode: pool of 17 blocks": "ok",
        "decode 1 rows x 32 context: capture": "ok",
        "decode 1 rows x 32 context": "ok",
        "decode 4 rows x 64 context: capture": "ok",
        "decode 4 rows x 64 context": "skipped",
    }


def test_the_command_line_samples_a_prompt_and_grades_it(tiny_model_dir, monkeypatch, capsys):
    """`python rollout.py` as typed; the same main() in this process reads the prompt from stdin and refuses a
    missing adapter."""
    import rollout

    args = [
        "--model",
        str(tiny_model_dir),
        "--samples",
        "3",
        "--max-new-tokens",
        "5",
        "--answer",
        "4",
        "--template",
        "plain",
    ]
    proc = subprocess.run(
        [sys.executable, "rollout.py", *args, "What is 2 + 2?"],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--- sample") == 3 and proc.stdout.rstrip().endswith("of 3 correct")
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 2?\n"))
    rollout.main(args)
    assert capsys.readouterr().out == proc.stdout, "stdin gives the same prompt"
    with pytest.raises(SystemExit) as exit_info:
        rollout.main([*args, "--adapter", "nowhere", "x"])
    assert exit_info.value.code == 2 and "--adapter nowhere" in capsys.readouterr().err


def test_the_command_line_fails_in_one_line_and_a_ctrl_c_exits_130(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import rollout

    (tmp_path / "empty").mkdir()  # an adapter folder without its files
    args = ["--model", str(tiny_model_dir), "--max-new-tokens", "4", "What is 2 + 2?"]
    for extra, message in (
        (["--adapter", str(tmp_path / "empty")], "adapter_config.json: not found"),
        (["--max-new-tokens", "300"], "exceeds the model's context"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            rollout.main([*args, *extra])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and message in err, err

    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(rollout, "generate", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        rollout.main(args)
    assert exit_info.value.code == 130 and capsys.readouterr().err.strip() == "rollout.py: interrupted"
