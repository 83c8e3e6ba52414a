"""Tests for model.py: parity with transformers on tiny random checkpoints of each family, and the
padding, log-prob and KV-cache paths against the plain forward pass. Loading and export: test_weights.py."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lora
import model as model_module
from conftest import assert_equal_to, hf_model
from infra import weights


def hf_logits(ref, ids, pad_mask=None):
    """Reference logits; with padding, give transformers the positions our model uses (real tokens only)."""
    if pad_mask is None:
        return ref(ids).logits
    positions = (pad_mask.long().cumsum(1) - 1).clamp(min=0)
    return ref(ids, attention_mask=pad_mask.long(), position_ids=positions).logits


def padded_batch(rows: list[list[int]], left: list[int], right: list[int], pad_id: int = 0):
    """Rows with the given numbers of left and right pads: ids [B, T], pad_mask [B, T]."""
    seqs = [[pad_id] * lp + row + [pad_id] * rp for row, lp, rp in zip(rows, left, right)]
    masks = [[False] * lp + [True] * len(row) + [False] * rp for row, lp, rp in zip(rows, left, right)]
    assert len({len(s) for s in seqs}) == 1, "rows must pad to one length"
    return torch.tensor(seqs), torch.tensor(masks)


def random_rows(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def test_logits_match_transformers(checkpoint):
    ours, ref = weights.from_pretrained(checkpoint), hf_model(checkpoint)
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    assert (ours(ids) - ref(ids).logits).abs().max() < 1e-4


@torch.no_grad()
def test_padded_batch_matches_transformers_and_single_rows(checkpoint):
    ours, ref = weights.from_pretrained(checkpoint), hf_model(checkpoint)
    rows = random_rows([9, 4, 6], ours.config.vocab_size)
    ids, pad_mask = padded_batch(rows, left=[0, 5, 1], right=[0, 0, 2])
    logits = ours(ids, pad_mask)
    reference = hf_logits(ref, ids, pad_mask)
    assert (logits - reference)[pad_mask].abs().max() < 1e-4
    for i, row in enumerate(rows):
        alone = ours(torch.tensor([row]))[0]
        assert (logits[i][pad_mask[i]] - alone).abs().max() < 1e-4


def test_token_logprobs_equal_plain_path_values_and_gradients(tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir)
    rows = random_rows([10, 7, 3], model.config.vocab_size, seed=2)
    ids, pad_mask = padded_batch(rows, left=[0, 3, 4], right=[0, 0, 3])
    temperature = 0.7
    loss_weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))  # an arbitrary loss

    # chunk_tokens=4 splits the 3 x 9 predicted positions into several chunks, one of them partial.
    logp, entropy = model.token_logprobs(ids, pad_mask, temperature=temperature, with_entropy=True, chunk_tokens=4)
    (logp * loss_weights).sum().backward()
    chunked_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()

    log_probs = torch.log_softmax(model(ids, pad_mask).float() / temperature, dim=-1)[:, :-1]
    expected = torch.cat([torch.zeros(3, 1), log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)], dim=1)
    expected_entropy = torch.cat([torch.zeros(3, 1), -(log_probs.exp() * log_probs).sum(-1)], dim=1)
    (expected * loss_weights).sum().backward()

    assert logp.shape == entropy.shape == ids.shape
    assert (logp - expected).abs().max() < 1e-5
    assert (entropy - expected_entropy).abs().max() < 1e-5
    assert torch.allclose(chunked_grad, model.lm_head.weight.grad, atol=1e-6)
    no_entropy = model.token_logprobs(ids, pad_mask, temperature=temperature)
    assert no_entropy[1] is None and torch.allclose(no_entropy[0], logp)


ENTROPY_MEMORY_SCRIPT = """
import sys, torch, lora, model as modeling
torch.manual_seed(0)
cfg = modeling.ModelConfig(num_layers=2)  # SmolLM2-135M's widths and vocabulary, two of its 30 layers
model = lora.inject(modeling.Transformer(cfg), rank=8, alpha=16).train()
ids = torch.randint(0, cfg.vocab_size, (2, 512))
h = model.hidden(ids)
bonus = sys.argv[1] == "2"  # an entropy bonus: the entropy is differentiated too
logp, entropy = model.hidden_logprobs(h, ids, start=1, with_entropy=sys.argv[1] != "0", entropy_grad=bonus,
                                      chunk_tokens=256)
(logp.sum() - (entropy.sum() if bonus else 0)).backward()
print(int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak resident size from /proc")
def test_entropy_keeps_no_graph_and_costs_no_memory(tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    logp, entropy = model.token_logprobs(ids, with_entropy=True, chunk_tokens=4)
    assert logp.grad_fn is not None and entropy.grad_fn is None and not entropy.requires_grad

    # A training micro-batch (4 chunks of [256, 49152] fp32) in three processes: without the entropy,
    # with it as a metric, and differentiated (a bonus). A graph kept per chunk would add about 350 MB to
    # a peak of about 740 MB (1.47x); the bonus's graph lives inside each chunk's checkpoint instead.
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", ENTROPY_MEMORY_SCRIPT, flag],
            cwd=Path(__file__).parent.parent,
            stdout=subprocess.PIPE,
            text=True,
        )
        for flag in ("0", "1", "2")
    ]
    without, with_entropy, with_bonus = (int(run.communicate(timeout=120)[0]) for run in runs)
    assert with_entropy < 1.3 * without, (with_entropy, without)
    assert with_bonus < 1.3 * without, (with_bonus, without)


def test_a_differentiated_entropy_has_the_plain_entropys_gradient(tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    _, entropy = model.hidden_logprobs(model.hidden(ids), ids, with_entropy=True, entropy_grad=True, chunk_tokens=4)
    entropy.sum().backward()
    chunked = model.lm_head.weight.grad.clone()
    model.zero_grad()
    log_probs = torch.log_softmax(model(ids).float(), dim=-1)[:, :-1]
    expected = -(log_probs.exp() * log_probs).sum(-1)
    expected.sum().backward()
    assert (entropy - expected).abs().max() < 1e-5
    assert torch.allclose(chunked, model.lm_head.weight.grad, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        model.token_logprobs(ids)[0].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        assert torch.allclose(plain, recomputed, atol=1e-6)


def test_training_pass_makes_no_tensor_off_the_models_device(tiny_model_dir):
    # Under a meta default device, a tensor created without device= lands on meta: mixing it with the
    # CPU model's tensors raises or gives different values, as a CPU tensor among CUDA ones would.
    model = lora.inject(weights.from_pretrained(tiny_model_dir), rank=2, alpha=4).train()
    model.gradient_checkpointing = True
    rows = random_rows([9, 5], model.config.vocab_size, seed=10)
    ids, pad_mask = padded_batch(rows, left=[0, 2], right=[0, 2])

    def training_pass():
        model.zero_grad()
        h = model.hidden(ids, pad_mask)
        logp, entropy = model.hidden_logprobs(h, ids, start=3, with_entropy=True, chunk_tokens=5)
        (logp * pad_mask[:, 3:]).sum().backward()
        return logp, entropy, [p.grad.clone() for p in lora.parameters(model)]

    expected = training_pass()
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        logp, entropy, grads = training_pass()
    finally:
        torch.set_default_device(previous)
    assert torch.equal(logp, expected[0]) and torch.equal(entropy, expected[1])
    assert all(torch.equal(g, e) for g, e in zip(grads, expected[2]))


@torch.no_grad()
@pytest.mark.parametrize("adapted", [False, True])
def test_paged_prefill_and_decode_equal_the_full_forward(checkpoint, adapted):
    """Two prompts prefilled into a KV pool of 4-slot blocks, one left-padded; prompt 0 (6 tokens) fills one
    block, which its two rows share, and each row gets its own copy of the partly filled second; then
    three decode steps, one row dead for a step, against the plain forward pass of each full row."""
    model = weights.from_pretrained(checkpoint).eval()
    if adapted:  # LoRA on every projection, with nonzero B: the decode step's low-rank terms are exercised
        lora.inject(model, rank=4, alpha=8.0)
        for p in lora.parameters(model):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    prompts = random_rows([6, 3], model.config.vocab_size, seed=5)
    prompt_ids, prompt_mask = padded_batch(prompts, left=[0, 3], right=[0, 0])
    pool = model_module.KVPool(model.config, 16, 4, model.dtype, model.device)
    prefill_table = torch.tensor([[1, 2] + [0] * 2, [3] + [0] * 3], dtype=torch.int32)
    h = model.prefill(prompt_ids, prompt_mask, model_module.PagedRows(pool, prefill_table, torch.zeros(2).long()))
    full = model.hidden(prompt_ids, prompt_mask)[:, -1]
    assert (h - full).abs().max() < 1e-4
    # rows 0, 1 continue prompt 0 (block 1 shared, block 2 copied to 4); rows 2, 3 prompt 1 (block 3 copied to 5)
    pool.copy_blocks(torch.tensor([2, 3]), torch.tensor([4, 5]))
    table = torch.tensor([[1, 2, 6, 0], [1, 4, 7, 0], [3, 8, 0, 0], [5, 9, 0, 0]], dtype=torch.int32)
    rows = model_module.PagedRows(pool, table, torch.tensor([6, 6, 3, 3]))
    continuation = torch.randint(3, model.config.vocab_size, (4, 3), generator=torch.Generator().manual_seed(6))
    weights_ = model_module.DecodeWeights(model)
    sequences = [list(prompts[r // 2]) for r in range(4)]
    for step, alive in enumerate([[True] * 4, [True, False, True, True], [True] * 4]):
        logits = model.decode_step(continuation[:, step], rows, span=12, weights=weights_)
        rows.length += torch.tensor(alive)  # a dead row's token is overwritten by its next one
        for r in (r for r in range(4) if alive[r]):
            sequences[r].append(continuation[r, step].item())
            assert (logits[r] - model(torch.tensor([sequences[r]]))[0, -1]).abs().max() < 1e-4, (step, r)


@pytest.mark.parametrize("rows", range(1, 7))
@pytest.mark.parametrize("in_features", [48, 2048])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_linear_is_linear_up_to_rounding(rows, in_features, with_bias):
    """Whichever side the weight takes, decode_linear gives F.linear's [rows, out], contiguous (the decode step
    views it per head), to fp32 rounding."""
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, in_features, generator=generator), torch.randn(40, in_features, generator=generator)
    bias = torch.randn(40, generator=generator) if with_bias else None
    out = model_module.decode_linear(x, weight, bias)
    assert out.shape == (rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


class RecordProducts(TorchDispatchMode):
    """The shape of each matrix product's left operand, run under it (shapes tell a weight from activations
    of fewer rows than it has, on meta as well)."""

    def __init__(self):
        super().__init__()
        self.left_shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm"):
            self.left_shapes.append(tuple((args[0] if name == "mm" else args[1]).shape))
        return func(*args, **(kwargs or {}))


needs_mkl = pytest.mark.skipif(
    not model_module.WEIGHT_LEFT_MEASURED, reason="decode_linear reorders products only where measured: torch with MKL"
)


@needs_mkl
@pytest.mark.parametrize(
    "rows, in_features, weight_left",
    [
        (1, 1536, True),
        (1, 2048, False),
        (2, 6144, True),
        (3, 6144, True),
        (4, 1536, True),
        (4, 2048, False),
        (5, 576, False),
        (8, 576, False),
    ],
)
def test_decode_linear_takes_the_side_measured_faster(rows, in_features, weight_left):
    """The fp32 CPU product has the weight on the left at two and three rows, at one and four up to 1536 input
    features, and never from five rows (bench/rollout.py --products); in bf16 and on meta, as on CUDA, it is
    F.linear's."""
    weight = torch.zeros(40, in_features)
    with RecordProducts() as recorded:
        model_module.decode_linear(torch.zeros(rows, in_features), weight)
    assert recorded.left_shapes == [(40, in_features) if weight_left else (rows, in_features)]
    for other in (weight.bfloat16(), weight.to("meta")):
        with RecordProducts() as recorded:
            model_module.decode_linear(torch.zeros(rows, in_features, dtype=other.dtype, device=other.device), other)
        assert recorded.left_shapes == [(rows, in_features)]


def test_the_products_benchmark_prints_both_sides_per_shape_and_row_count(monkeypatch, capsys):
    """bench/rollout.py --products on two small shapes: per row count, each shape's F.linear / decode_linear
    times and their ratio, and the step's total."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "bench"))
    spec = importlib.util.spec_from_file_location(
        "bench_rollout", Path(__file__).parent.parent / "bench" / "rollout.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "PRODUCT_SHAPES", {"tiny": {(24, 16): 3, (16, 24): 2}})
    bench.bench_products(repeats=1)
    lines = capsys.readouterr().out.splitlines()
    assert "24x16" in lines[1] and "16x24" in lines[1] and lines[1].rstrip().endswith("step")
    rows = [line.split() for line in lines[2:]]
    assert [int(cells[0]) for cells in rows] == list(range(1, 7))
    assert all(len(cells) == 1 + 3 * 4 and [c[-1] for c in cells[4::4]] == ["x"] * 3 for cells in rows)


@needs_mkl
@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 4, 5])
def test_a_few_row_cpu_decode_step_puts_every_weight_on_the_left(tiny_model_dir, rows):
    """With one to four rows, each of a small model's CPU decode step's 7 projections per layer and its vocabulary
    projection is one product with the weight on the left (decode_linear); with five, none is."""
    model = weights.from_pretrained(tiny_model_dir).eval()
    pool = model_module.KVPool(model.config, 8, 4, model.dtype, model.device)
    table = torch.arange(1, rows + 1, dtype=torch.int32)[:, None]
    paged = model_module.PagedRows(pool, table, torch.zeros(rows, dtype=torch.long))
    decode = model_module.DecodeWeights(model)
    with RecordProducts() as recorded:
        model.decode_step(torch.zeros(rows, dtype=torch.long), paged, span=4, weights=decode)
    assert len(recorded.left_shapes) == 7 * model.config.num_layers + 1
    weight_left = [shape[0] != rows for shape in recorded.left_shapes]  # every weight has more than 5 rows
    assert all(weight_left) if rows <= 4 else not any(weight_left)


def test_decode_weights_follow_the_adapters_in_place(tiny_model_dir):
    """refresh copies new adapter values into the same buffers (CUDA graphs read their addresses); a change of
    which projections carry a term (disabled adapters) asks for new DecodeWeights."""
    model = weights.from_pretrained(tiny_model_dir).eval()
    lora.inject(model, rank=2, alpha=4.0, targets=("q_proj", "v_proj", "up_proj"))
    decode = model_module.DecodeWeights(model)
    _, A, Bs = decode.groups[0]  # layer 0's q, k, v: q's and v's A side by side, k without a term
    assert A.shape == (model.config.hidden_size, 4) and Bs[1] is None
    address = A.data_ptr()
    with torch.no_grad():
        for p in lora.parameters(model):
            p.fill_(0.5)
    decode.refresh(model)
    assert A.data_ptr() == address and (A == 0.5).all()
    assert torch.equal(Bs[0][:2], torch.full_like(Bs[0][:2], 0.5 * 2.0)) and not Bs[0][2:].any()  # scale alpha/r = 2
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
    """Each prompt run once for its rows (hidden_shared) against every row run whole (hidden), in float64:
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
            h = model.hidden_shared(prompt_ids, prompt_mask, owner, completion_ids, completion_mask)
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


def test_the_demo_pass_with_shared_prompts_does_under_half_the_work_in_half_the_memory():
    """bench/model.py counts the demo's training pass on the meta device (FLOPs, and tensor bytes as the
    memory plan counts them): each prompt run once against every row run whole."""
    run = subprocess.run(
        [sys.executable, "bench/model.py", "--device", "meta", "--bench", "grpo"],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    flops, memory = (float(x.rstrip("x")) for x in run.stdout.splitlines()[-1].split()[-2:])
    assert flops < 0.4 and memory <= 0.5, run.stdout
