"""LoRA adapters for the Transformer in model.py, stored in PEFT's on-disk format.

A LoRA layer computes W x + (alpha / r) * B A dropout(x), where W is the frozen pretrained weight
and only A [r, in] and B [out, r] train. B starts at zero, so a freshly injected model is exactly
the base model. For GRPO this matters twice over: the optimizer holds state for a few million
parameters instead of billions, and the frozen base, reached through `disabled(model)`, serves
as the reference policy for a KL penalty without a second copy of the model.

Base weights keep their dtype (bf16 on GPU) and their state-dict names, so checkpoints load the
same way with or without adapters; the adapter parameters are fp32 so small updates are not
rounded away. On disk an adapter is adapter_config.json + adapter_model.safetensors with PEFT's
key names, so `peft.PeftModel.from_pretrained` loads it onto the transformers model, and back.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT wraps the causal LM; its saved keys start with this


class LoRALinear(nn.Module):
    """An nn.Linear with a low-rank trainable update. `weight` and `bias` are the base layer's own
    (frozen) parameters under their original names; the adapter is lora_A, lora_B as in PEFT."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        device = base.weight.device
        # Held as nn.Linear so the state-dict keys are PEFT's (lora_A.weight); forward uses the weights directly.
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        # A as nn.Linear's own default (Kaiming-uniform, a=sqrt(5)), which is also PEFT's; B zero.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout)
        self.merged = False  # B A is currently added into weight
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.merged or not self.enabled:
            return out
        # Compute in the activations' dtype, as autocast would: bf16 matmuls and no fp32 copy of x,
        # while the fp32 parameters (and optimizer) still keep small updates from rounding away.
        A, scaled_B = self.lora_A.weight.to(x.dtype), (self.scale * self.lora_B.weight).to(x.dtype)
        return out + F.linear(F.linear(self.dropout(x), A), scaled_B)

    def low_rank(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [r, in], scale * B [out, r]) in fp32 while the adapter adds to the output (not merged, not
        disabled), else None. The sampler's decode step casts these once per rollout (engine.decode_weights.DecodeWeights)
        instead of casting and scaling them at every token as forward does."""
        if self.merged or not self.enabled:
            return None
        return self.lora_A.weight, self.scale * self.lora_B.weight

    def delta_weight(self) -> torch.Tensor:
        """scale * B A [out, in] in fp32."""
        return self.scale * (self.lora_B.weight @ self.lora_A.weight)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The base weight with the adapter folded in, in the base dtype; self is not modified."""
        if self.merged:
            return self.weight
        return (self.weight.float() + self.delta_weight()).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, merged={self.merged}, enabled={self.enabled}"


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _matches(module_name: str, targets) -> bool:
    """PEFT's rule for a list of target names: the module's name, or its last dotted components."""
    return any(module_name == t or module_name.endswith("." + t) for t in targets)


def inject(model: nn.Module, rank: int, alpha: float, targets=DEFAULT_TARGETS, dropout: float = 0.0) -> nn.Module:
    """Wrap every nn.Linear whose name matches targets in a LoRALinear, in place, and freeze
    everything else. Returns the model."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if isinstance(targets, str):
        raise ValueError(f"targets must be a list of module names such as ('q_proj', 'v_proj'), got {targets!r}")
    if lora_modules(model):
        raise ValueError("model already has LoRA adapters; inject() once per model")
    chosen = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and _matches(name, targets)]
    if not chosen:
        raise ValueError(f"targets {tuple(targets)} match no nn.Linear module of the model")
    # A tied weight (lm_head with tied embeddings) would be merged into its twin as well.
    owners = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(param_name)
    for name in chosen:
        tied = owners[id(model.get_submodule(name).weight)]
        if len(tied) > 1:
            raise ValueError(f"targets: {name} shares its weight with {tied}; LoRA on tied weights is not supported")
    model.requires_grad_(False)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, alpha, dropout))
    return model


def parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The trainable adapter parameters (lora_A and lora_B of every wrapped layer)."""
    for module in lora_modules(model).values():
        yield module.lora_A.weight
        yield module.lora_B.weight


@torch.no_grad()
def merge(model: nn.Module) -> None:
    """Add B A into the base weights so the forward pass costs nothing extra. In bf16 the sum is
    rounded, so merge followed by unmerge restores the base weights only approximately."""
    for module in lora_modules(model).values():
        if not module.merged:
            module.weight.copy_(module.merged_weight())
            module.merged = True


@torch.no_grad()
def unmerge(model: nn.Module) -> None:
    """Subtract B A from the base weights again (the inverse of merge)."""
    for module in lora_modules(model).values():
        if module.merged:
            module.weight.copy_((module.weight.float() - module.delta_weight()).to(module.weight.dtype))
            module.merged = False


@contextmanager
def disabled(model: nn.Module):
    """Run the frozen base model: inside the block every adapter is skipped."""
    modules = lora_modules(model).values()
    if any(m.merged for m in modules):
        raise ValueError("disabled(): adapters are merged into the base weights; unmerge(model) first")
    previous = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was_enabled in zip(modules, previous):
            m.enabled = was_enabled


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under its base names, adapters folded into the weights, without
    modifying the model. This is what an exported checkpoint holds."""
    state = {name: t for name, t in model.state_dict().items() if ".lora_" not in name}
    for name, module in lora_modules(model).items():
        state[f"{name}.weight"] = module.merged_weight()
    return state


def save(model: nn.Module, path: str | Path, base_model_name_or_path: str | None = None) -> None:
    """Write the adapters as a PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors)."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("save(): the model has no LoRA adapters; call inject() first")
    first = next(iter(modules.values()))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": first.dropout.p,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    tensors = {}
    for name, module in modules.items():
        tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = module.lora_A.weight.detach().contiguous()
        tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = module.lora_B.weight.detach().contiguous()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, path / WEIGHTS_FILE)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with two fixes: the file gets the user's umask like every other file (save_file
    creates it 0600, unreadable to the others on a shared machine), and a failed write (a full disk) is an
    OSError naming the file, not a SafetensorError."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as error:  # "... I/O error: No space left on device (os error 28)"
        code = int(m[1]) if (m := re.search(r"os error (\d+)", str(error))) else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from None
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def load(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a PEFT LoRA checkpoint (ours or PEFT's) into model, injecting adapters first if it has none."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config, config_file, weights_file = read_config(path), path / CONFIG_FILE, path / WEIGHTS_FILE
    if not lora_modules(model):
        inject(model, config["r"], config["lora_alpha"], config["target_modules"], config.get("lora_dropout", 0.0))
    modules = lora_modules(model)
    for module in modules.values():
        if module.merged:
            raise ValueError("load(): adapters are merged into the base weights; unmerge(model) first")
        if (module.rank, module.alpha) != (config["r"], config["lora_alpha"]):
            raise ValueError(
                f"{config_file}: r={config['r']}, lora_alpha={config['lora_alpha']} differ from the "
                f"model's adapters (r={module.rank}, alpha={module.alpha})"
            )
    try:
        tensors = load_file(weights_file)
    except SafetensorError as error:  # truncated or not a safetensors file at all
        raise ValueError(f"{weights_file}: not a readable safetensors file ({error})") from None
    expected = {
        f"{PEFT_PREFIX}{name}.lora_{ab}.weight": getattr(module, f"lora_{ab}").weight
        for name, module in modules.items()
        for ab in "AB"
    }
    if set(tensors) != set(expected):
        missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
        raise ValueError(
            f"{weights_file}: keys do not match the model's adapters; "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for key, weight in expected.items():
        if tensors[key].shape != weight.shape:
            raise ValueError(
                f"{weights_file}: {key} has shape {list(tensors[key].shape)}, the model's adapter "
                f"{list(weight.shape)}: an adapter of another model?"
            )
    with torch.no_grad():
        for name, module in modules.items():
            module.lora_A.weight.copy_(tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"])
            module.lora_B.weight.copy_(tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"])
    return model


def read_config(path: str | Path) -> dict:
    """The adapter_config.json of an adapter directory, after checking that both files are there and that
    it asks for nothing this plain LoRA lacks; reads no weights, so a caller can check before loading a model."""
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(f"{file}: not found; an adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file}: not valid JSON ({error})") from None
    if not isinstance(config, dict) or not all(key in config for key in ("r", "lora_alpha")):
        raise ValueError(f"{config_file}: not an adapter config (it needs r and lora_alpha)")
    _check_supported(config, config_file)
    return config


def _check_supported(config: dict, config_file: Path) -> None:
    """Reject PEFT options this plain LoRA does not implement, rather than load them wrongly."""
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r} is not supported (only 'LORA')")
    if not isinstance(config.get("target_modules"), list):
        raise ValueError(
            f"{config_file}: target_modules must be a list of module names, got {config.get('target_modules')!r}"
        )
    unsupported = {
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "bias": "none",
        "rank_pattern": {},
        "alpha_pattern": {},
        "fan_in_fan_out": False,
    }
    for key, plain in unsupported.items():
        if config.get(key, plain) not in (plain, None):
            raise ValueError(f"{config_file}: {key}={config[key]!r} is not supported (only {plain!r})")
