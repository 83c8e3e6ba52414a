"""Tests for model.py: parity with transformers on tiny random checkpoints of each family, and the
padding, log-prob, entropy and checkpointing paths against the plain forward pass. Loading and export:
test_weights.py; the engine's paged cache and shared-prompt pass: test_engine.py."""

import torch

import lora
import model as modeling
from conftest import hf_model
from engine.counting import LiveBytes
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


def entropy_pass_peak(entropy: str, tokens: int, chunk_tokens: int, vocab: int) -> int:
    """Peak bytes the log-prob pass and its backward allocate (LiveBytes) over `tokens` tokens of a small model:
    entropy "none", as a metric, or as a bonus (differentiated)."""
    torch.manual_seed(0)
    cfg = modeling.ModelConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32
    )
    model = lora.inject(modeling.Transformer(cfg), rank=4, alpha=8).train()
    ids = torch.randint(0, vocab, (2, tokens // 2))
    hidden = model.hidden(ids)
    bonus = entropy == "bonus"
    with LiveBytes() as live:
        logp, entropies = model.hidden_logprobs(
            hidden, ids, start=1, with_entropy=entropy != "none", entropy_grad=bonus, chunk_tokens=chunk_tokens
        )
        (logp.sum() - (entropies.sum() if bonus else 0)).backward()
    return live.peak


def test_entropy_keeps_no_graph_and_costs_no_memory(tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    logp, entropy = model.token_logprobs(ids, with_entropy=True, chunk_tokens=4)
    assert logp.grad_fn is not None and entropy.grad_fn is None and not entropy.requires_grad

    # A graph kept per chunk would hold a [chunk, V] block per chunk until the backward, so its cost would grow
    # with the number of chunks. As a metric the entropy adds only its [N] values; as a bonus its graph lives
    # inside each chunk's checkpoint, so what it adds is the same for 8 chunks as for 16.
    chunk, vocab = 64, 4096
    block = chunk * vocab * 4
    added = {}
    for tokens in (8 * chunk, 16 * chunk):
        plain = entropy_pass_peak("none", tokens, chunk, vocab)
        added[tokens] = {kind: entropy_pass_peak(kind, tokens, chunk, vocab) - plain for kind in ("metric", "bonus")}
    for extra in added.values():
        assert extra["metric"] < block / 16, added
        assert 0 < extra["bonus"] < 4 * block, added
    assert abs(added[16 * chunk]["bonus"] - added[8 * chunk]["bonus"]) < block / 2, added


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
