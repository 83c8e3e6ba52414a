"""A ten-minute GPU check: CUDA-graph parity, rollout speed and a LoRA training step, on random-weight Qwen3.

    python3 bench/gpu_check.py --out DIR [--models Qwen3-1.7B Qwen3-8B] [--caps 512 4096]
    python3 bench/gpu_check.py --device cpu --tiny --out DIR    # the dry run that test_rollout.py does

Needs torch and transformers only (peft for the training reference, skipped without it): no network,
no checkpoint, no .venv. Speed and memory depend on shapes, not weight values, so the models are
Qwen3 shapes (bench/qwen3_shapes.py) with seeded random bf16 weights. For each model, in one run:
1. parity: the fixed-shape decode loop replayed from CUDA graphs against the same loop run eagerly
   (greedy and sampled, rows ending at scattered steps, so rows are compacted): the same tokens. On
   the CPU, which has no graphs, the fixed-shape loop against the eager CPU loop.
2. rollout at each cap, forced length (every row runs to the cap) and long tail (rows stop at seeded
   log-normal lengths, as in bench/rollout.py): rollout.generate against transformers' generate with
   a static cache and torch.compile (CUDA; no compile on the CPU). Cap <= 1024: 32 prompts x 8
   samples, else 8 prompts x 8 samples (the 1.7B preset's rollout); 128-token prompts. For the long
   tail ours also runs forced at the tail's mean length, the issue's point of comparison.
3. train: one LoRA micro-batch (r=32 on all projections, gradient checkpointing; bench/model.py's
   steps and GPU shapes) against transformers + peft.
Every run records its peak allocated memory (torch.cuda.max_memory_allocated, weights included; the
CPU has no allocator statistics: null there). One table is printed; DIR/gpu_check.json holds it all.
Exit status 1 when parity fails or one of our runs fails; a failing reference run is only recorded.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import rollout  # noqa: E402
from qwen3_shapes import QWEN3, QWEN3_TINY  # noqa: E402


def load_bench(name: str):
    """bench/NAME.py as the module bench_NAME: its plain name belongs to the file it measures."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_model, bench_rollout = load_bench("model"), load_bench("rollout")
PROMPT_LEN = 128


class Check:
    """Times runs, records them as table rows with their peak memory, and lets no failure stop the rest."""

    def __init__(self, device: torch.device):
        self.device, self.rows, self.failed = device, [], False

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, model: str, phase: str, side: str, fn, tokens=None, steps=None, ours: bool = True):
        """fn() timed once; returns its result (None if it failed). tokens and steps may be functions of
        the result; they give tokens/s and ms per decode step."""
        row = dict(model=model, phase=phase, side=side, seconds=None, tokens_per_s=None, ms_per_step=None,
                   peak_allocated_bytes=None, status="ok")
        self.free()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        result = None
        try:
            self.sync()
            start = time.perf_counter()
            result = fn()
            self.sync()
            row["seconds"] = seconds = time.perf_counter() - start
        except Exception as err:  # noqa: BLE001 - recorded in the table, and the check goes on
            traceback.print_exc()
            row["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
            self.failed |= ours
        if self.device.type == "cuda":
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        if row["status"] == "ok":
            tokens, steps = (x(result) if callable(x) else x for x in (tokens, steps))
            row["tokens_per_s"] = tokens / seconds if tokens else None
            row["ms_per_step"] = 1000 * seconds / steps if steps else None
        self.rows.append(row)
        print(format_row(row), flush=True)
        return result

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the phases


def random_prompts(count: int, length: int, vocab: int, seed: int, varied: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (count,), generator=g).tolist() if varied else [length] * count
    return [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def check_parity(check: Check, name: str, ours, tiny: bool) -> dict:
    """Graph replay against the eager fixed-shape loop (CUDA), or the fixed-shape loop against the eager
    CPU loop: the same tokens, greedy and sampled, with rows ending at scattered steps."""
    vocab = ours.config.vocab_size
    prompts = random_prompts(4 if tiny else 8, 12 if tiny else 64, vocab, seed=1, varied=True)
    stops = list(range(3, 3 + max(1, vocab // 40)))  # about 1 token in 40 ends a row under a random model
    if check.device.type == "cuda":
        variants = {"graphs": dict(fixed_shapes=True, cuda_graphs="on"),
                    "eager": dict(fixed_shapes=True, cuda_graphs="off")}
    else:
        variants = {"fixed shapes": dict(fixed_shapes=True), "eager loop": dict(fixed_shapes=False)}
    result = {"compared": " vs ".join(variants), "ok": True}
    for temperature in (0.0, 1.0):
        outs = [check.run(name, f"parity t={temperature:g} {variant}", "ours", lambda kwargs=kwargs: rollout.generate(
                    ours, prompts, samples_per_prompt=4, max_new_tokens=16 if tiny else 96, temperature=temperature,
                    stop_ids=stops, seed=0, **kwargs), tokens=lambda out: int(out.completion_mask.sum()))
                for variant, kwargs in variants.items()]
        same = None not in outs and outs[0].completions == outs[1].completions
        lengths = outs[0].completion_mask.sum(1) if outs[0] is not None else None
        result[f"t={temperature:g}"] = {
            "same_tokens": same,
            "max_old_logp_diff": (outs[0].old_logp - outs[1].old_logp).abs().max().item() if same else None,
            "lengths_min_max": None if lengths is None else [int(lengths.min()), int(lengths.max())],
        }
        result["ok"] &= same
    check.failed |= not result["ok"]
    print(f"parity ({result['compared']}): {'ok' if result['ok'] else 'FAILED'} {result}", flush=True)
    return result


def rollout_shape(cap: int, tiny: bool) -> tuple[int, int, int]:
    """(prompts, samples, prompt length) of the rollout runs at a cap."""
    if tiny:
        return 2, 2, 8
    return (32, 8, PROMPT_LEN) if cap <= 1024 else (8, 8, PROMPT_LEN)


def check_rollout(check: Check, name: str, hf, ours, cap: int, tiny: bool) -> None:
    """Ours and transformers (static cache + compile) at one cap, forced length and long tail."""
    prompts_n, samples, prompt_len = rollout_shape(cap, tiny)
    rows = prompts_n * samples
    prompts = random_prompts(prompts_n, prompt_len, ours.config.vocab_size, seed=2)
    lengths = bench_rollout.long_tail_lengths(rows, cap, seed=cap)
    mean = round(sum(lengths) / rows)
    hf_extra = dict(cache_implementation="static")
    if check.device.type == "cuda":
        from transformers import CompileConfig

        hf_extra["compile_config"] = CompileConfig()
    shape = f"{prompts_n}x{samples} rows, cap {cap}"

    def ours_run(new_tokens, row_lengths):
        return lambda: bench_rollout.ours_generate(ours, prompts, samples, new_tokens, row_lengths)

    def hf_run(row_lengths):
        return lambda: bench_rollout.hf_generate(hf, prompts, samples, cap, 0, row_lengths, **hf_extra)

    def steps(out) -> int:  # decode steps taken, from either side's output
        return out.completion_ids.shape[1] if isinstance(out, rollout.Rollout) else out.shape[1] - prompt_len

    check.run(name, f"rollout {shape}, forced", "ours", ours_run(cap, None), tokens=rows * cap, steps=cap)
    check.run(name, f"rollout {shape}, long tail (mean {mean})", "ours", ours_run(cap, lengths),
              tokens=sum(lengths), steps=steps)
    check.run(name, f"rollout {shape}, forced at the tail's mean {mean}", "ours", ours_run(mean, None),
              tokens=rows * mean, steps=mean)
    # warm-up at the same static-cache shape (rows stop after 4 tokens): compile is not timed
    check.run(name, f"rollout {shape}, warm-up (compile)", "transformers", hf_run([4] * rows), ours=False)
    check.run(name, f"rollout {shape}, forced", "transformers", hf_run(None), tokens=rows * cap, steps=cap,
              ours=False)
    check.run(name, f"rollout {shape}, long tail (mean {mean})", "transformers", hf_run(lengths),
              tokens=sum(lengths), steps=steps, ours=False)


def check_training(check: Check, name: str, tiny: bool) -> None:
    """One LoRA micro-batch, ours against transformers + peft, one side at a time (best of 2 steps)."""
    batch, seq = (2, 64) if tiny else bench_model.GPU_BATCHES.get(name, (8, 2048))
    shape = f"train {batch}x{seq} LoRA r{bench_model.RANK}"
    sides = [("ours", bench_model.build_ours, bench_model.ours_step)]
    if importlib.util.find_spec("peft") is not None:
        sides.append(("transformers + peft", bench_model.build_peft, bench_model.peft_step))
    else:
        print("peft is not installed: the training step runs without its reference", flush=True)
    for side, build, step in sides:
        model = check.run(name, f"{shape}: build", side, lambda: build(name, check.device.type), ours=side == "ours")
        if model is None:
            continue
        ids, pad_mask = bench_model.random_batch(batch, seq, model.config.vocab_size, check.device)
        check.run(name, f"{shape}: warm-up step", side, lambda: step(model, ids, pad_mask), ours=side == "ours")
        for _ in range(2):
            check.run(name, f"{shape}: step", side, lambda: step(model, ids, pad_mask),
                      tokens=batch * seq, ours=side == "ours")
        del model


def check_model(check: Check, name: str, caps: list[int], tiny: bool) -> dict:
    torch.manual_seed(0)
    hf, ours = bench_rollout.build_qwen3(name, check.device.type)
    weights_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    results = {"weights_bytes": weights_bytes, "parity": check_parity(check, name, ours, tiny)}
    for cap in caps:
        check_rollout(check, name, hf, ours, cap, tiny)
    del hf, ours
    if check.device.type == "cuda":
        torch._dynamo.reset()  # drop the compiled graphs and their memory before training
    check.free()
    check_training(check, name, tiny)
    return results


# ----------------------------------------------------------------------------- report


def format_row(row: dict) -> str:
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    peak = None if row["peak_allocated_bytes"] is None else row["peak_allocated_bytes"] / 2**30
    status = "" if row["status"] == "ok" else row["status"][:60]
    return (f"{row['model']:<11} {row['phase']:<50} {row['side']:<20} {number(row['seconds'], '8.2f')} "
            f"{number(row['tokens_per_s'], '10,.0f')} {number(row['ms_per_step'], '8.2f')} {number(peak, '9.2f')} {status}")


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


HEADER = (f"{'model':<11} {'phase':<50} {'side':<20} {'seconds':>8} {'tokens/s':>10} {'ms/step':>8} "
          f"{'peak GiB':>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out", required=True, help="directory for gpu_check.json")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--models", nargs="+", choices=list(QWEN3), default=["Qwen3-1.7B"])
    parser.add_argument("--caps", nargs="+", type=int, default=[512, 4096], help="max_new_tokens of the rollout runs")
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen3 and caps of 8 and 16: a dry run")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu --tiny for a dry run)")
    device = torch.device(args.device)
    models, caps = (list(QWEN3_TINY), [8, 16]) if args.tiny else (args.models, args.caps)
    if args.tiny:
        torch.set_num_threads(1)  # tiny matrices gain nothing from more threads, and lose on a busy machine
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import transformers

    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": version_of("peft"),
        "models": {},
    }
    print(f"{report['device']}, torch {report['torch']}, transformers {report['transformers']}, "
          f"peft {report['peft']}\n{HEADER}", flush=True)
    check = Check(device)
    for name in models:
        report["models"][name] = check_model(check, name, caps, args.tiny)
    report["rows"] = check.rows
    report["ok"] = not check.failed
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"\n{HEADER}\n" + "\n".join(format_row(row) for row in check.rows))
    print(f"\n{'ok' if report['ok'] else 'FAILED'}: {out_dir / 'gpu_check.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
