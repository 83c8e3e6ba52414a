"""Tests for lora.py: the adapter's identities (zero init, merge, disable), training only the
adapters, and the PEFT on-disk format checked against the real peft package."""

import json

import pytest
import torch

import lora
from conftest import make_tiny_checkpoint
from infra import weights


def trained_like(model, seed=0):
    """Give every adapter a non-zero B, as training would, so the adapters change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in lora.lora_modules(model).values():
            module.lora_B.weight.copy_(0.1 * torch.randn(module.lora_B.weight.shape, generator=g))
    return model


def sample_ids(model, shape=(2, 10), seed=1):
    return torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def test_zero_initialized_adapters_leave_logits_unchanged(tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir)
    ids = sample_ids(model)
    base = model(ids)
    lora.inject(model, rank=4, alpha=8)
    assert len(lora.lora_modules(model)) == 2 * 7  # every default target in both layers
    assert torch.equal(model(ids), base)
    module = model.model.layers[0].self_attn.q_proj
    assert module.lora_A.weight.abs().sum() > 0 and module.lora_B.weight.abs().sum() == 0


def test_only_adapters_train(tiny_model_dir):
    model = lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8, targets=("q_proj", "v_proj"))
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in lora.parameters(model)}
    assert len(trainable) == 2 * 2 * 2  # A and B, two targets, two layers
    ids = sample_ids(model)
    with torch.no_grad():
        base = model(ids)
    optimizer = torch.optim.SGD(lora.parameters(model), lr=1.0)
    model.token_logprobs(ids)[0].sum().neg().backward()
    optimizer.step()
    with torch.no_grad():
        assert (model(ids) - base).abs().max() > 1e-3
        with lora.disabled(model):
            assert torch.equal(model(ids), base)


def test_gradient_checkpointing_gives_the_same_adapter_gradients(tiny_model_dir):
    model = trained_like(lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8)).train()
    ids = sample_ids(model)
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = checkpointing
        model.token_logprobs(ids)[0].sum().backward()
        grads.append([p.grad.clone() for p in lora.parameters(model)])
    for plain, recomputed in zip(*grads):
        assert torch.allclose(plain, recomputed, atol=1e-6)


@torch.no_grad()
def test_merge_unmerge_and_disable(tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir)
    ids = sample_ids(model)
    base, base_weights = model(ids), {k: v.clone() for k, v in model.state_dict().items()}
    trained_like(lora.inject(model, rank=4, alpha=16))
    adapted = model(ids)
    assert (adapted - base).abs().max() > 1e-2
    with lora.disabled(model):
        assert torch.equal(model(ids), base)
    assert torch.equal(model(ids), adapted)  # re-enabled on exit

    lora.merge(model)
    weight = model.model.layers[0].mlp.down_proj.weight
    assert not torch.allclose(weight, base_weights["model.layers.0.mlp.down_proj.weight"])
    assert (model(ids) - adapted).abs().max() < 1e-5
    with pytest.raises(ValueError, match="unmerge"):
        with lora.disabled(model):
            pass
    lora.unmerge(model)
    assert (model(ids) - adapted).abs().max() < 1e-5
    for name, tensor in model.state_dict().items():
        if ".lora_" not in name:
            assert torch.allclose(tensor, base_weights[name], atol=1e-6), name


@torch.no_grad()
def test_bf16_base_keeps_fp32_adapters(tiny_model_dir):
    model = trained_like(lora.inject(weights.from_pretrained(tiny_model_dir, dtype=torch.bfloat16), rank=4, alpha=8))
    module = model.model.layers[1].mlp.up_proj
    assert module.weight.dtype == torch.bfloat16 and module.lora_A.weight.dtype == torch.float32
    reference = trained_like(lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8))
    for ours, ref in zip(lora.parameters(model), lora.parameters(reference)):
        ours.copy_(ref)
    ids = sample_ids(model)
    logits = model(ids)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - reference(ids)).abs().max() < 0.05


def test_dropout_applies_in_training_only(tiny_model_dir):
    model = trained_like(lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8, dropout=0.5))
    ids = sample_ids(model)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), model(ids))
        torch.manual_seed(0)
        assert not torch.allclose(model.train()(ids), model(ids))


@torch.no_grad()
def test_save_load_round_trip(tmp_path, tiny_model_dir):
    targets = ("k_proj", "down_proj")
    model = trained_like(lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8, targets=targets))
    lora.save(model, tmp_path, base_model_name_or_path=str(tiny_model_dir))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["down_proj", "k_proj"])

    restored = lora.load(weights.from_pretrained(tiny_model_dir), tmp_path)  # injects from the config
    ids = sample_ids(model)
    assert torch.equal(restored(ids), model(ids))


def test_load_rejects_mismatches(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load(weights.from_pretrained(tiny_model_dir), tmp_path)
    lora.save(lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8), tmp_path)
    with pytest.raises(ValueError, match="r=4, lora_alpha=8 differ"):
        lora.load(lora.inject(weights.from_pretrained(tiny_model_dir), rank=2, alpha=8), tmp_path)
    with pytest.raises(ValueError, match="missing"):
        lora.load(lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8, targets=("lm_head",)), tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        lora.load(weights.from_pretrained(tiny_model_dir), tmp_path)


def test_inject_rejects_bad_arguments(tmp_path, tiny_model_dir):
    model = weights.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="match no nn.Linear"):
        lora.inject(model, rank=4, alpha=8, targets=("qkv",))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        lora.inject(model, rank=0, alpha=8)
    lora.inject(model, rank=4, alpha=8)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.inject(model, rank=4, alpha=8)
    tied = weights.from_pretrained(make_tiny_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True))
    with pytest.raises(ValueError, match="shares its weight"):
        lora.inject(tied, rank=4, alpha=8, targets=("lm_head",))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        lora.save(weights.from_pretrained(tiny_model_dir), "unused")


@torch.no_grad()
def test_our_adapter_loads_in_peft(tmp_path, tiny_model_dir):
    from peft import PeftModel

    model = trained_like(lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8))
    lora.save(model, tmp_path)
    peft_model = PeftModel.from_pretrained(hf_model(tiny_model_dir), tmp_path).eval()
    ids = sample_ids(model)
    assert (peft_model(ids).logits - model(ids)).abs().max() < 1e-4


@torch.no_grad()
def test_peft_adapter_loads_in_ours(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "o_proj", "up_proj"], task_type="CAUSAL_LM")
    peft_model = get_peft_model(hf_model(tiny_model_dir), config)
    torch.manual_seed(2)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.normal_(std=0.1)
    peft_model.save_pretrained(tmp_path)
    ours = lora.load(weights.from_pretrained(tiny_model_dir), tmp_path)
    assert len(lora.lora_modules(ours)) == 2 * 3
    ids = sample_ids(ours)
    assert (peft_model.eval()(ids).logits - ours(ids)).abs().max() < 1e-4


@torch.no_grad()
def test_merged_export_loads_in_transformers(tmp_path, tiny_model_dir):
    model = trained_like(lora.inject(weights.from_pretrained(tiny_model_dir), rank=4, alpha=8))
    ids = sample_ids(model)
    adapted = model(ids)
    weights.save_pretrained(model, tmp_path)
    assert torch.equal(model(ids), adapted)  # the export left the model as it was (unmerged)
    assert (hf_model(tmp_path)(ids).logits - adapted).abs().max() < 1e-4
    assert (hf_model(tiny_model_dir)(ids).logits - adapted).abs().max() > 1e-2  # the adapters are in it
