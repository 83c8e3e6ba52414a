"""Tests for the engine's decode path on tiny random checkpoints: the paged KV cache's prefill and decode
step against the full forward pass, gather attention by prompt group against the row by row one,
the decode step's products (packed on the CPU) against F.linear, the benchmarks' plumbing, the decode
weights following the adapters and the weights, the shared-prompt training pass against whole rows, and the CUDA graph
capture's calls. The sampler end to end (scheduler, preemption, graphs): test_rollout.py."""

import contextlib
import dataclasses
import importlib.util
import re
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from test_model import padded_batch, random_rows
from torch.utils._python_dispatch import TorchDispatchMode

import lora
from conftest import assert_equal_to
from engine import decode_weights, memory
from engine.decode_weights import DecodeWeights, PackedWeights, decode_linear, packed_linear, packs_weights
from engine.graphs import CudaGraph
from engine.kv_cache import (
    DecodeAttention,
    KVPool,
    PagedRows,
    PromptGroups,
    decode_step,
    flex_paged_attention_available,
    prefill,
)
from engine.shared_prompts import hidden_shared
from infra import weights
from model import ModelConfig, Transformer

ROOT = Path(__file__).parent.parent
needs_packing = pytest.mark.skipif(
    not packs_weights(torch.device("cpu"), torch.float32), reason="this torch runs no packed oneDNN linear"
)


def load_bench(monkeypatch, name: str):
    """bench/NAME.py as a module, with bench/ on the path as when it runs as a script."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def available_paths() -> list:
    """Every paged attention path, the ones this torch or device lacks skipped with the reason."""
    flash = "needs CUDA and torch's paged varlen_attn (block_table)"
    return [
        "gather",
        pytest.param("flex", marks=pytest.mark.skipif(not flex_paged_attention_available(), reason="no block masks")),
        pytest.param("flash", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=flash)),
    ]


@torch.no_grad()
@pytest.mark.parametrize("attention", available_paths())
@pytest.mark.parametrize("adapted", [False, True])
def test_paged_prefill_and_decode_equal_the_full_forward(checkpoint, adapted, attention):
    """On each attention path: two prompts prefilled into a KV pool of 4-slot blocks, one left-padded; prompt 0 (6 tokens) fills one
    block, which its two rows share, and each row gets its own copy of the partly filled second; then
    three decode steps, one row dead for a step, against the plain forward pass of each full row."""
    model = weights.from_pretrained(checkpoint).eval()
    if adapted:  # LoRA on every projection, with nonzero B: the decode step's low-rank terms are exercised
        lora.inject(model, rank=4, alpha=8.0)
        for p in lora.parameters(model):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    prompts = random_rows([6, 3], model.config.vocab_size, seed=5)
    prompt_ids, prompt_mask = padded_batch(prompts, left=[0, 3], right=[0, 0])
    pool = KVPool(model.config, 16, 4, model.dtype, model.device, attention)
    prefill_table = torch.tensor([[1, 2] + [0] * 2, [3] + [0] * 3], dtype=torch.int32)
    h = prefill(model, prompt_ids, prompt_mask, PagedRows(pool, prefill_table, torch.zeros(2).long()))
    full = model.hidden(prompt_ids, prompt_mask)[:, -1]
    assert (h - full).abs().max() < 1e-4
    # rows 0, 1 continue prompt 0 (block 1 shared, block 2 copied to 4); rows 2, 3 prompt 1 (block 3 copied to 5)
    pool.copy_blocks(torch.tensor([2, 3]), torch.tensor([4, 5]))
    table = torch.tensor([[1, 2, 6, 0], [1, 4, 7, 0], [3, 8, 0, 0], [5, 9, 0, 0]], dtype=torch.int32)
    rows = PagedRows(pool, table, torch.tensor([6, 6, 3, 3]))
    continuation = torch.randint(3, model.config.vocab_size, (4, 3), generator=torch.Generator().manual_seed(6))
    weights_ = DecodeWeights(model)
    sequences = [list(prompts[r // 2]) for r in range(4)]
    for step, alive in enumerate([[True] * 4, [True, False, True, True], [True] * 4]):
        logits = decode_step(model, continuation[:, step], rows, span=12, weights=weights_)
        rows.length += torch.tensor(alive)  # a dead row's token is overwritten by its next one
        for r in (r for r in range(4) if alive[r]):
            sequences[r].append(continuation[r, step].item())
            assert (logits[r] - model(torch.tensor([sequences[r]]))[0, -1]).abs().max() < 1e-4, (step, r)


@torch.no_grad()
@pytest.mark.parametrize("attention", available_paths())
@pytest.mark.parametrize("rows", range(1, 6))
def test_a_decode_step_of_a_few_rows_equals_the_full_forward(tiny_model_dir, rows, attention):
    """One to five rows (a long tail's last steps) on each attention path: each row's logits after its prompt are
    the plain forward pass's."""
    model = weights.from_pretrained(tiny_model_dir).eval()
    prompts = random_rows([3 + r for r in range(rows)], model.config.vocab_size, seed=rows)
    pool = KVPool(model.config, 1 + 2 * rows, 4, model.dtype, model.device, attention)
    table = torch.arange(1, 1 + 2 * rows, dtype=torch.int32).view(rows, 2)  # two 4-slot blocks per row
    for r, prompt in enumerate(prompts):
        row = PagedRows(pool, table[r : r + 1], torch.zeros(1, dtype=torch.long))
        prefill(model, torch.tensor([prompt[:-1]]), torch.ones(1, len(prompt) - 1, dtype=torch.bool), row)
    paged = PagedRows(pool, table, torch.tensor([len(p) - 1 for p in prompts]))
    logits = decode_step(model, torch.tensor([p[-1] for p in prompts]), paged, span=8)
    for r, prompt in enumerate(prompts):
        assert (logits[r] - model(torch.tensor([prompt]))[0, -1]).abs().max() < 1e-4, r


def test_grouped_gather_attention_reads_each_prompt_once_and_equals_the_row_by_row_one():
    """Six rows in three prompt groups over random blocks of a float64 pool of 4-slot blocks: a prompt of 9 tokens
    (two shared blocks) with three rows, one of 3 tokens (none shared) with one, one of 5 (one shared) with two,
    each row filled to its own length. Attention over the groups' key sequences gives the outputs of the row by
    row gather, and copies each shared block once where the row by row gather copies it for every row."""
    g = torch.Generator().manual_seed(0)
    pool = KVPool(ModelConfig(num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8), 40, 4, torch.float64, "cpu")
    pool.kv.normal_(generator=g)
    ids = (torch.randperm(39, generator=g) + 1).tolist()  # distinct blocks, none of them block 0
    shared = [ids[:2], [], ids[2:3]]
    group_of, lengths = [0, 0, 0, 1, 2, 2], [13, 9, 16, 3, 10, 6]
    own, blocks = iter(ids[3:]), []
    for u, length in zip(group_of, lengths):  # each row's blocks cover its slots 0..length
        blocks.append(shared[u] + [next(own) for _ in range(-(-(length + 1) // 4) - len(shared[u]))])
    groups = [(len(shared[u]), [b for b, v in zip(blocks, group_of) if v == u]) for u in range(3)]
    table = torch.tensor([b + [0] * (6 - len(b)) for b in blocks], dtype=torch.int32)
    q = torch.randn(6, 6, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(6, 2, 2, 8, generator=g, dtype=torch.float64)
    by_row = DecodeAttention(PagedRows(pool, table, torch.tensor(lengths)), span=24)
    by_group = DecodeAttention(PagedRows(pool, table, torch.tensor(lengths), PromptGroups.of(groups, "cpu")), 24)
    torch.testing.assert_close(by_group(1, q, kv), by_row(1, q, kv), rtol=0, atol=1e-12)
    copied = by_group.gather.tolist()
    assert [copied.count(block) for block in ids[:3]] == [1, 1, 1]
    assert [by_row.gather.tolist().count(block) for block in ids[:3]] == [3, 3, 2]
    # 3 groups of the longest key sequence: the first group's 2 shared blocks and 2 + 1 + 3 own; 6 x 6 by row
    assert len(copied) == 3 * 8 and len(by_row.gather) == 6 * 6


@pytest.mark.parametrize("rows", [1, 3, 32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_packing)])
def test_the_decode_products_are_linear_up_to_rounding(rows, with_bias, packed):
    """decode_linear on the parameters, and packed_linear on the same weights packed side by side in two parts
    (a group's q and k, say), give F.linear's [rows, out], contiguous (the decode step views it per head), to fp32
    rounding, with a residual added too; decode_linear also writes into a column slice of a wider output (the
    group's side-by-side outputs, the columns beside it untouched). A packed product reads a strided input."""
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 2 * 48, generator=generator)[:, ::2], torch.randn(40, 48, generator=generator)
    bias = torch.randn(40, generator=generator) if with_bias else None
    expected = torch.nn.functional.linear(x, weight, bias)
    residual = torch.randn(rows, 40, generator=generator)
    if packed:
        parts = [torch.nn.Linear(48, 30, bias=with_bias), torch.nn.Linear(48, 10, bias=False)]
        with torch.no_grad():
            parts[0].weight.copy_(weight[:30])
            parts[1].weight.copy_(weight[30:])
            if bias is not None:  # the second part has no bias of its own: zeros stand in for it
                parts[0].bias.copy_(bias[:30])
                expected[:, 30:] -= bias[30:]
        product = partial(packed_linear, x, PackedWeights.of(parts))
    else:
        product = partial(decode_linear, x, weight, bias)
    out = product()
    assert out.shape == (rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(product(residual=residual), residual + expected, rtol=1e-5, atol=1e-4)
    if not packed:
        wide = torch.full((rows, 50), 7.0)
        decode_linear(x, weight, bias, out=wide[:, 5:45])
        torch.testing.assert_close(wide[:, 5:45], expected, rtol=1e-5, atol=1e-4)
        assert (wide[:, :5] == 7).all() and (wide[:, 45:] == 7).all()


def test_products_are_packed_in_fp32_on_the_cpu_alone():
    """packs_weights: fp32 on a CPU with oneDNN; never in float64 (the exact reference), bf16 or on meta (the
    plan's device, standing in for CUDA), whose decode steps read the parameters themselves."""
    assert packs_weights(torch.device("cpu"), torch.float32) == torch.backends.mkldnn.is_available()
    assert not packs_weights(torch.device("cpu"), torch.float64)
    assert not packs_weights(torch.device("cpu"), torch.bfloat16)
    assert not packs_weights(torch.device("meta"), torch.float32)
    meta = DecodeWeights(Transformer(ModelConfig(num_layers=1, vocab_size=64)).to("meta"))
    assert not meta.packs and all(group.packed is None for group in meta.groups + [meta.vocabulary])


@needs_packing
@torch.no_grad()
def test_packed_weights_are_packed_again_when_a_weight_changes(tiny_model_dir):
    """A full-parameter update changes the weights in place between rollouts, and loading assigns new tensors:
    refresh packs again exactly the groups whose weights changed either way, so the decode step's logits stay
    the full forward's; with no change it packs nothing."""
    model = weights.from_pretrained(tiny_model_dir).eval()
    prompt = random_rows([5], model.config.vocab_size, seed=3)[0]
    decode = DecodeWeights(model)
    assert decode.packs and all(group.packed is not None for group in decode.groups + [decode.vocabulary])

    def packed_objects():
        return [group.packed for group in decode.groups + [decode.vocabulary]]

    def last_logits() -> torch.Tensor:
        pool = KVPool(model.config, 3, 4, model.dtype, model.device)
        rows = PagedRows(pool, torch.tensor([[1, 2]], dtype=torch.int32), torch.zeros(1, dtype=torch.long))
        prefill(model, torch.tensor([prompt[:-1]]), torch.ones(1, len(prompt) - 1, dtype=torch.bool), rows)
        rows.length += len(prompt) - 1
        return decode_step(model, torch.tensor(prompt[-1:]), rows, span=8, weights=decode)[0]

    before = packed_objects()
    decode.refresh(model)
    assert all(a is b for a, b in zip(packed_objects(), before))
    model.model.layers[1].mlp.up_proj.weight.mul_(-2.0)  # in place, as an optimizer step
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.weight = torch.nn.Parameter(torch.randn_like(o_proj.weight))  # a new tensor, as loading assigns
    decode.refresh(model)
    changed = [i for i, (a, b) in enumerate(zip(packed_objects(), before)) if a is not b]
    assert changed == [1, 4 + 2]  # layer 0's o_proj group, layer 1's gate/up group
    assert (last_logits() - model(torch.tensor([prompt]))[0, -1]).abs().max() < 1e-4
    model.lm_head.weight.add_(1.0)  # tied to the embedding in the tiny model: the vocabulary is packed again
    decode.refresh(model)
    assert decode.vocabulary.packed is not before[-1]
    assert (last_logits() - model(torch.tensor([prompt]))[0, -1]).abs().max() < 1e-4


@needs_packing
def test_the_products_benchmark_prints_both_sides_per_shape_and_row_count(monkeypatch, capsys):
    """bench/rollout.py --products on two small shapes: per row count, each shape's F.linear / packed times and
    their ratio, and the step's total."""
    bench = load_bench(monkeypatch, "rollout")
    monkeypatch.setattr(bench, "PRODUCT_SHAPES", {"tiny": {(24, 16): 3, (16, 24): 2}})
    bench.bench_products(repeats=1)
    lines = capsys.readouterr().out.splitlines()
    assert "24x16" in lines[1] and "16x24" in lines[1] and lines[1].rstrip().endswith("step")
    rows = [line.split() for line in lines[2:]]
    assert [int(cells[0]) for cells in rows] == list(bench.PRODUCT_ROWS)
    assert all(len(cells) == 1 + 3 * 4 and [c[-1] for c in cells[4::4]] == ["x"] * 3 for cells in rows)


def test_the_decode_products_alone_are_those_of_a_decode_step(monkeypatch, tiny_model_dir):
    """bench/rollout.py's "our decode products alone" runs, per step, the products decode_step runs: each projection
    group's and the vocabulary projection, once each."""
    bench = load_bench(monkeypatch, "rollout")
    model = weights.from_pretrained(tiny_model_dir).eval()
    calls = []
    monkeypatch.setattr(DecodeWeights, "project", lambda self, index, x, residual=None: calls.append(index))
    monkeypatch.setattr(DecodeWeights, "logits", lambda self, x: calls.append("vocabulary"))
    bench.decode_products(model, rows=3, steps=2)
    step = list(range(4 * model.config.num_layers)) + ["vocabulary"]
    assert calls == step + step


def test_the_profile_prints_each_operators_share_of_one_call(monkeypatch, capsys, tiny_model_dir):
    """bench/rollout.py --profile's table for one rollout.generate call of the tiny model: every operator's share
    of the call's self CPU time, largest first and adding up to the whole, with its calls; the draw's
    log_softmax runs once per decode step and once for the first tokens."""
    bench = load_bench(monkeypatch, "rollout")
    model, prompts = weights.from_pretrained(tiny_model_dir), [[5, 17, 42, 9], [100, 3, 77]]
    out = bench.operator_shares(lambda: bench.ours_generate(model, prompts, 2, 6), top=10**4)
    header, _, *lines = capsys.readouterr().out.splitlines()
    assert re.match(r"self CPU time [0-9.]+ s \(load average [0-9.]+\), [0-9]+ minor page faults$", header)
    shares = {name: (float(share[:-1]), int(calls)) for name, share, calls in (line.split() for line in lines)}
    assert [share for share, _ in shares.values()] == sorted((share for share, _ in shares.values()), reverse=True)
    assert abs(sum(share for share, _ in shares.values()) - 100) < 0.1 * len(shares)
    assert out.stats.decode_steps == 5 and shares["aten::_log_softmax"][1] == 5 + 1


def test_decode_weights_follow_the_adapters_in_place(tiny_model_dir):
    """refresh copies new adapter values into the same buffers (CUDA graphs read their addresses); a change of
    which projections carry a term (disabled adapters) asks for new DecodeWeights."""
    model = weights.from_pretrained(tiny_model_dir).eval()
    lora.inject(model, rank=2, alpha=4.0, targets=("q_proj", "v_proj", "up_proj"))
    decode = DecodeWeights(model)
    A, B = decode.groups[0].A, decode.groups[0].B  # layer 0's q, k, v: q's and v's A side by side, k without
    q, k, v = decode.groups[0].sizes
    assert A.shape == (model.config.hidden_size, 4) and B.shape == (4, q + k + v)
    address = A.data_ptr()
    with torch.no_grad():
        for p in lora.parameters(model):
            p.fill_(0.5)
    decode.refresh(model)
    assert A.data_ptr() == address and (A == 0.5).all()
    blocks = torch.zeros_like(B)  # block-diagonal: q's rows feed q's columns, v's rows v's; scale alpha/r = 2
    blocks[:2, :q], blocks[2:, q + k :] = 1.0, 1.0
    assert torch.equal(B, blocks)
    with lora.disabled(model), pytest.raises(ValueError, match="build new DecodeWeights"):
        decode.refresh(model)


def shared_prompt_batch(vocab: int, completion_len: int):
    """3 prompts of 5, 3 and 6 tokens (left-padded) and 7 rows of them, in mixed order, whose completions
    of up to completion_len tokens are right-padded; one row of prompt 0 has a single token."""
    prompts = random_rows([5, 3, 6], vocab, seed=11)
    prompt_ids, prompt_mask = padded_batch(prompts, left=[1, 3, 0], right=[0, 0, 0])
    owner = torch.tensor([0, 2, 0, 1, 2, 2, 0])
    lengths = [completion_len, 2, 3, 1, completion_len, 2, completion_len - 1]
    completions = random_rows(lengths, vocab, seed=12)
    right = [completion_len - n for n in lengths]
    completion_ids, completion_mask = padded_batch(completions, left=[0] * 7, right=right)
    return prompt_ids, prompt_mask, owner, completion_ids, completion_mask


@pytest.mark.parametrize("completion_len", [4, 40])  # at most twice the head size (heads folded), and more
@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompts_give_the_states_and_gradients_of_whole_rows(checkpoint, completion_len, checkpointing):
    """Each prompt run once for its rows (hidden_shared) against every row run whole (model.hidden), in float64:
    the states and every adapter's gradient through both the completions and the prompts."""
    model = lora.inject(weights.from_pretrained(checkpoint).to(torch.float64), rank=4, alpha=8).train()
    model.gradient_checkpointing = checkpointing
    with torch.no_grad():  # B starts at zero, so the gradient of A would be too: a small update of each layer
        for module in lora.lora_modules(model).values():
            module.lora_B.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
    prompt_ids, prompt_mask, owner, completion_ids, completion_mask = shared_prompt_batch(
        model.config.vocab_size, completion_len
    )
    P = prompt_ids.shape[1]
    used = torch.cat([torch.ones_like(completion_mask[:, :1]), completion_mask], 1)  # [R, 1 + C]
    loss_weights = torch.randn(*used.shape, model.config.hidden_size, dtype=torch.float64) * used[..., None]

    def states_and_grads(shared: bool):
        model.zero_grad()
        if shared:
            h = hidden_shared(model, prompt_ids, prompt_mask, owner, completion_ids, completion_mask)
        else:
            ids = torch.cat([prompt_ids[owner], completion_ids], 1)
            # the last prompt token's state, then the completion's
            h = model.hidden(ids, torch.cat([prompt_mask[owner], completion_mask], 1))[:, P - 1 :]
        (h * loss_weights).sum().backward()
        return h[used], [p.grad.clone() for p in lora.parameters(model)]

    (shared, shared_grads), (whole, whole_grads) = states_and_grads(True), states_and_grads(False)
    assert_equal_to(shared, whole)
    for got, expected in zip(shared_grads, whole_grads):
        assert expected.abs().max() > 0
        assert_equal_to(got, expected)


def test_the_demo_pass_with_shared_prompts_does_under_half_the_work_in_half_the_memory(monkeypatch, capsys):
    """bench/model.py counts the demo's training pass on the meta device (FLOPs, and tensor bytes as the
    memory plan counts them): each prompt run once against every row run whole."""
    bench = load_bench(monkeypatch, "model")
    monkeypatch.setattr(sys, "argv", ["bench/model.py", "--device", "meta", "--bench", "grpo"])
    bench.main()
    out = capsys.readouterr().out
    flops, memory = (float(x.rstrip("x")) for x in out.splitlines()[-1].split()[-2:])
    assert flops < 0.4 and memory <= 0.5, out


def test_cuda_graph_capture_neither_synchronizes_nor_empties_the_cache(monkeypatch):
    """CudaGraph.capture with torch.cuda's streams and graphs replaced by recorders: two warm-ups on a side
    stream, then capture_begin into the shared memory pool, the step, capture_end; torch.cuda.synchronize and
    torch.cuda.empty_cache, which the torch.cuda.graph context manager calls, are never called."""
    events = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            events.append("wait")

        def capture_begin(self, pool=None):
            events.append(("capture_begin", pool))

        def capture_end(self):
            events.append("capture_end")

        def replay(self):
            events.append("replay")

    def forbidden(*args, **kwargs):
        raise AssertionError("a capture must not synchronize or empty the allocator's cache")

    monkeypatch.setattr(torch.cuda, "Stream", Recorder)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Recorder)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: Recorder())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    graph = CudaGraph()
    graph.capture(lambda: events.append("step"), "pool handle")
    graph.replay()
    assert events == ["wait", "step", "step", ("capture_begin", "pool handle"), "step", "capture_end", "wait", "replay"]


def decode_step_launches(cfg, adapted: bool, rows: int = 16) -> list[str]:
    """The operators of one decode step of `rows` rows that launch a kernel, counted on the meta device under
    inference mode (see LaunchedOperators), for a bf16 model of cfg on the flash path (CUDA's), with rank-32
    adapters on all seven projections when `adapted`."""
    with torch.device("meta"):
        meta_model = Transformer(cfg).to(torch.bfloat16)
    if adapted:
        lora.inject(meta_model, 32, 64.0)
    pool = KVPool(cfg, 8, 256, torch.bfloat16, "meta", "flash")
    table = torch.zeros(rows, 4, dtype=torch.int32, device="meta")
    paged = PagedRows(pool, table, torch.zeros(rows, dtype=torch.long, device="meta"))
    decode = DecodeWeights(meta_model)
    with torch.inference_mode(), LaunchedOperators() as launched:
        decode_step(meta_model, torch.zeros(rows, dtype=torch.long, device="meta"), paged, 1024, decode)
    return launched.names


def launches_per_layer(cfg, adapted: bool) -> tuple[int, int]:
    """(operators of a whole decode step, operators of one layer): a layer's count is the difference between
    one- and two-layer models of cfg (layers are alike); the step's is the whole model's."""
    one, two = (len(decode_step_launches(dataclasses.replace(cfg, num_layers=n), adapted)) for n in (1, 2))
    total = len(decode_step_launches(cfg, adapted))
    assert total == one + (cfg.num_layers - 1) * (two - one)  # the rest is per step, not per layer
    return total, two - one


def test_a_decode_step_of_qwen3_with_lora_launches_at_most_25_operators_a_layer():
    """Qwen3-1.7B with rank-32 adapters on all seven projections, 16 rows: each layer's norms, projections,
    adapter terms, q/k norm, RoPE, cache write, attention and MLP launch at most 25 kernels, and the step's
    own (embedding, the rotation, attention's indices, the final norm and the vocabulary projection) few."""
    cfg = memory.model_config("Qwen/Qwen3-1.7B")
    total, per_layer = launches_per_layer(cfg, adapted=True)
    assert per_layer <= 25, per_layer
    assert total - cfg.num_layers * per_layer <= 32, total


@needs_packing
def test_packed_products_run_each_group_as_one_operator(monkeypatch):
    """On the CPU in fp32 the packed path runs q, k and v as one product and gate and up as one, the residual
    as the product's post-op: per layer three operators fewer than the products on the parameters (counted
    as test_a_decode_step_of_qwen3_with_lora_launches_at_most_25_operators_a_layer counts, on the gather path),
    with or without adapters."""
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
    )

    def per_layer(adapted: bool) -> int:
        counts = []
        for layers in (1, 2):
            model = Transformer(dataclasses.replace(cfg, num_layers=layers)).eval()
            if adapted:
                lora.inject(model, 4, 8.0)
            pool = KVPool(model.config, 5, 4, torch.float32, "cpu")
            paged = PagedRows(pool, torch.arange(1, 5, dtype=torch.int32).view(2, 2), torch.tensor([2, 5]))
            decode = DecodeWeights(model)
            with torch.inference_mode(), LaunchedOperators() as launched:
                decode_step(model, torch.tensor([3, 7]), paged, 8, decode)
            counts.append(len(launched.names))
        return counts[1] - counts[0]

    packed = {adapted: per_layer(adapted) for adapted in (False, True)}
    monkeypatch.setattr(decode_weights, "packs_weights", lambda device, dtype: False)
    plain = {adapted: per_layer(adapted) for adapted in (False, True)}
    assert packed == {adapted: plain[adapted] - 3 for adapted in (False, True)}, (packed, plain)


@pytest.mark.parametrize("name", ["Qwen/Qwen3-1.7B", None], ids=["Qwen3-1.7B", "SmolLM2-135M"])
def test_lora_adds_two_operators_a_layer_per_projection_group(name):
    """Adapters on all seven projections add, per layer and per group reading one input (q/k/v, o, gate/up,
    down), one product of the group's A's and one of its block-diagonal B: 8 operators a layer."""
    cfg = memory.model_config(name)
    _, base = launches_per_layer(cfg, adapted=False)
    _, adapted = launches_per_layer(cfg, adapted=True)
    assert adapted - base == 8, (base, adapted)


class LaunchedOperators(TorchDispatchMode):
    """Records the aten operators that launch a kernel. Under inference mode a dispatch mode sees composite
    operators whole (F.linear, Tensor.to, reshape): each is decomposed here into what it runs, except
    F.rms_norm, one fused kernel on CUDA (torch >= 2.8; on meta and the CPU it decomposes). Views (view,
    reshape of a contiguous tensor, split, narrow, transpose, detach: their schema returns an alias) and
    allocations without a kernel (empty, new_empty) are not counted."""

    FUSED = (torch.ops.aten.rms_norm.default,)
    ALLOCATIONS = (
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten._unsafe_view.default,  # reshape's view of the copy it made
    )

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
        if composite and func not in self.FUSED:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if not func.is_view and func not in self.ALLOCATIONS:
            self.names.append(str(func))
        return func(*args, **kwargs)
