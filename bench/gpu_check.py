"""A GPU check within a time budget: CUDA-graph parity, rollout speed and memory, and a LoRA training step, on
random-weight Qwen3-1.7B and then Qwen3-8B, sampled and trained with LoRA adapters as the trainer has them.

    python3 bench/gpu_check.py                                  # both models, caps 512 and 4096, 540 s
    python3 bench/gpu_check.py --models Qwen3-1.7B --budget-s 300 --out DIR
    python3 bench/gpu_check.py --device cpu --tiny --out DIR    # the dry run that test_rollout.py does

Needs torch and transformers only (peft for the training reference, skipped without it): no network,
no checkpoint, no .venv. Speed and memory depend on shapes, not weight values, so the models are
Qwen3 shapes (bench/qwen3_shapes.py) with seeded random bf16 weights and rank-32 LoRA adapters on all
seven projections (B nonzero, so the adapters do work). For each model, in order:
1. parity: the fixed-shape decode loop replayed from CUDA graphs against the same loop run eagerly over
   the same pool (greedy and sampled, rows ending at scattered steps): the same tokens. On the CPU,
   EagerGraph stands in for the graphs, so the script takes the same branches.
2. rollout at each cap, 128-token prompts, 32 prompts x 8 samples (8 x 8 above cap 1024): ours over a
   KV pool that holds every row (a warm-up call captures the graphs, which later calls reuse), forced
   length and long tail (rows stop at bench/rollout.py's seeded log-normal lengths), against
   transformers' generate with a static cache and torch.compile after a compile warm-up. Each run of
   ours also records the memory plan's peak for it (weights, adapters and pool as allocated, plus
   memory.sampling_phase) next to torch.cuda.max_memory_allocated.
3. train: one LoRA micro-batch (bench/model.py's steps and GPU shapes) against transformers + peft.
Every row is printed as it finishes and DIR/gpu_check.json is rewritten after each, so a run cut short
keeps what it measured. Before each run the time it will take is estimated from the runs so far (a kind's
first run from its first_s: a compile warm-up's is COMPILE_S); a run that would end past --budget-s is
skipped and recorded so. Each row records the peak memory allocated and reserved (graph pools stay reserved).
Exit status 1 when parity fails or one of our runs fails; a failing reference run is only recorded.
"""

from __future__ import annotations

import os

# Before torch starts CUDA, as train.py does: the sampler's pool and the activations do not fragment memory.
if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from qwen3_shapes import QWEN3, QWEN3_TINY  # noqa: E402

import lora  # noqa: E402
import rollout  # noqa: E402
from engine import memory  # noqa: E402
from engine.graphs import CudaGraph, EagerGraph  # noqa: E402
from engine.pool import Pool  # noqa: E402


def load_bench(name: str):
    """bench/NAME.py as the module bench_NAME: its plain name belongs to the file it measures."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_model, bench_rollout = load_bench("model"), load_bench("rollout")
PROMPT_LEN = 128
COMPILE_S = 120.0  # the estimate of a first torch.compile warm-up (a kind not yet timed), before one is timed
DEFAULT_OUT = "runs/gpu-check"


class Check:
    """Times runs, records them as table rows with their peak memory, rewrites the JSON after each, skips
    what the budget cannot hold, and lets no failure stop the rest."""

    def __init__(self, device: torch.device, report: dict, out_file: Path, budget_s: float, clock=time.perf_counter):
        self.device, self.report, self.out_file, self.clock = device, report, out_file, clock
        self.start, self.budget_s = clock(), budget_s
        self.rows, self.failed = report.setdefault("rows", []), False
        self.rates: dict[str, float] = {}  # seconds per unit of work, by kind of run

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(
        self,
        model: str,
        phase: str,
        side: str,
        fn,
        tokens=None,
        steps=None,
        ours: bool = True,
        work: float = 0.0,
        kind: str | None = None,
        planned=None,
        first_s: float = 0.0,
    ):
        """fn() timed once; returns its result (None if it failed or was skipped). tokens and steps may be
        functions of the result; they give tokens/s and ms per decode step. work (in any unit) and kind
        estimate the time from earlier runs of the kind; first_s is the estimate of a kind's first run (a
        compile warm-up's), so even a first run is skipped when it cannot end within the budget; planned(result)
        gives the planned peak bytes."""
        row = dict(
            model=model,
            phase=phase,
            side=side,
            seconds=None,
            tokens_per_s=None,
            ms_per_step=None,
            peak_allocated_bytes=None,
            peak_reserved_bytes=None,  # graph pools and the allocator's cache: what the GPU actually gives up
            planned_peak_bytes=None,
            status="ok",
        )
        elapsed = self.clock() - self.start
        estimate = self.rates[kind] * work if kind in self.rates else first_s
        if elapsed + estimate > self.budget_s:
            row["status"] = f"skipped: budget ({elapsed:.0f} s spent, about {estimate:.0f} s more needed)"
            return self._record(row, None)
        self.free()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        result = None
        try:
            self.sync()
            start = self.clock()
            result = fn()
            self.sync()
            row["seconds"] = seconds = self.clock() - start
        except Exception as err:  # noqa: BLE001 - recorded in the table, and the check goes on
            traceback.print_exc()
            row["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
            self.failed |= ours
        if self.device.type == "cuda":
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        if row["status"] == "ok":
            tokens, steps = (x(result) if callable(x) else x for x in (tokens, steps))
            row["tokens_per_s"] = tokens / seconds if tokens else None
            row["ms_per_step"] = 1000 * seconds / steps if steps else None
            row["planned_peak_bytes"] = planned(result) if planned is not None else None
            if kind is not None and work:
                self.rates[kind] = max(self.rates.get(kind, 0.0), seconds / work)
        return self._record(row, result)

    def _record(self, row: dict, result):
        self.rows.append(row)
        print(format_row(row), flush=True)
        self.out_file.write_text(json.dumps(self.report, indent=2))
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


def with_adapters(model) -> None:
    """Rank-32 LoRA on all seven projections, as the trainer injects it, with B nonzero (trained adapters)."""
    lora.inject(model, bench_model.RANK, bench_model.ALPHA)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for module in lora.lora_modules(model).values():
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=g) * 0.01)


def new_pool(ours, prompts: list[list[int]], samples: int, new_tokens: int) -> Pool:
    """A pool that holds every row at full length, with CUDA graphs on CUDA and their stand-in elsewhere."""
    graph_class = CudaGraph if ours.device.type == "cuda" else EagerGraph
    return Pool.for_groups(ours, [len(p) for p in prompts], samples, new_tokens, graph_class=graph_class)


def forced_generate(lengths: list[int], stop_id: int, *args, **kwargs):
    """rollout.generate with row i drawing stop_id as its lengths[i]-th token."""
    with bench_rollout.forced_lengths(lengths, stop_id):
        return rollout.generate(*args, **kwargs)


def check_parity(check: Check, name: str, ours, tiny: bool) -> dict:
    """The fixed-shape loop replayed from graphs (CUDA graphs, or EagerGraph on the CPU) against the same loop
    run eagerly over the same pool: the same tokens, greedy and sampled, rows ending at scattered steps."""
    vocab = ours.config.vocab_size
    prompts = random_prompts(4 if tiny else 8, 12 if tiny else 64, vocab, seed=1, varied=True)
    new_tokens = 16 if tiny else 96
    # rows end at scattered steps by a forced stop token (bench/rollout.py's forced_lengths): one stop id keeps
    # torch.isin off the sorting path (with a sync) that thousands of stop ids send it down
    stop_id = 3
    lengths = torch.randint(1, new_tokens + 1, (len(prompts) * 4,), generator=torch.Generator().manual_seed(2))
    pool = new_pool(ours, prompts, 4, new_tokens)
    variants = {"graphs": "on", "eager": "off"}
    result = {"compared": "graphs vs eager", "attention": pool.attention, "ok": True}
    for temperature in (0.0, 1.0):
        outs = [
            check.run(
                name,
                f"parity t={temperature:g} {variant}",
                "ours",
                lambda graphs=graphs: forced_generate(
                    lengths.tolist(),
                    stop_id,
                    ours,
                    prompts,
                    samples_per_prompt=4,
                    max_new_tokens=new_tokens,
                    temperature=temperature,
                    stop_ids=[stop_id],
                    seed=0,
                    fixed_shapes=True,
                    cuda_graphs=graphs,
                    pool=pool,
                ),
                tokens=lambda out: int(out.completion_mask.sum()),
                steps=lambda out: out.stats.decode_steps,
            )
            for variant, graphs in variants.items()
        ]
        if any(row["status"].startswith("skipped") for row in check.rows[-2:]):
            result[f"t={temperature:g}"], result["ok"] = "skipped: budget", None
            break
        same = None not in outs and outs[0].completions == outs[1].completions
        lengths = outs[0].completion_mask.sum(1) if outs[0] is not None else None
        result[f"t={temperature:g}"] = {
            "same_tokens": same,
            "max_old_logp_diff": (outs[0].old_logp - outs[1].old_logp).abs().max().item() if same else None,
            "lengths_min_max": None if lengths is None else [int(lengths.min()), int(lengths.max())],
            "captures": None if outs[0] is None else outs[0].stats.captures,
        }
        result["ok"] &= same
    check.failed |= result["ok"] is False
    verdict = {True: "ok", False: "FAILED", None: "skipped"}[result["ok"]]
    print(f"parity ({result['compared']}, {pool.attention} attention): {verdict} {result}", flush=True)
    return result


def rollout_shape(cap: int, tiny: bool) -> tuple[int, int, int]:
    """(prompts, samples, prompt length) of the rollout runs at a cap."""
    if tiny:
        return 2, 2, 8
    return (32, 8, PROMPT_LEN) if cap <= 1024 else (8, 8, PROMPT_LEN)


def planned_peak(ours, pool: Pool, prompts: int, samples: int, prompt_len: int, cap: int) -> int:
    """The memory plan's peak for a rollout of this shape: weights, adapters and pool as allocated (no
    optimizer in this script), plus memory.sampling_phase's transients counted on the meta device."""
    work = memory.Workload(
        dtype=ours.dtype,
        lora_rank=bench_model.RANK,
        prompt_len=prompt_len,
        max_new_tokens=cap,
        group_size=samples,
        prompts_per_step=prompts,
        rollout_prompts=prompts,
    )
    planner = memory.Planner.of(ours.config, work)
    resident = sum(p.numel() * p.element_size() for p in ours.parameters())
    resident += pool.kv.k.numel() * pool.kv.k.element_size() * 2
    return resident + planner.measure("rollout", prompts)[1]


def check_rollout(check: Check, name: str, hf, ours, cap: int, tiny: bool) -> None:
    """Ours and transformers (static cache + compile) at one cap, forced length and long tail."""
    prompts_n, samples, prompt_len = rollout_shape(cap, tiny)
    rows = prompts_n * samples
    prompts = random_prompts(prompts_n, prompt_len, ours.config.vocab_size, seed=2)
    lengths = bench_rollout.long_tail_lengths(rows, cap, seed=cap)
    mean = round(sum(lengths) / rows)
    shape = f"{prompts_n}x{samples} rows, cap {cap}"
    pool = check.run(name, f"rollout {shape}: pool", "ours", lambda: new_pool(ours, prompts, samples, cap))
    if pool is None:
        return
    compile_config = compile_settings(check.device)

    def ours_run(new_tokens, row_lengths):
        return lambda: bench_rollout.ours_generate(
            ours, prompts, samples, new_tokens, row_lengths, pool=pool, cuda_graphs="on"
        )

    def hf_run(row_lengths):
        return lambda: bench_rollout.hf_generate(
            hf, prompts, samples, cap, 0, row_lengths, cache_implementation="static", compile_config=compile_config
        )

    def steps(out) -> int:  # decode steps taken, from either side's output
        return out.stats.decode_steps if isinstance(out, rollout.Rollout) else out.shape[1] - prompt_len

    def planned(out) -> int:
        return planned_peak(ours, pool, prompts_n, samples, prompt_len, cap)

    ours_kind, hf_kind = f"{name} ours rollout", f"{name} hf rollout"
    check.run(
        name,
        f"rollout {shape}, warm-up (graph captures)",
        "ours",
        ours_run(cap, lengths),
        ours=True,
        work=rows * mean,
        kind=ours_kind,
    )
    check.run(
        name,
        f"rollout {shape}, forced",
        "ours",
        ours_run(cap, None),
        tokens=rows * cap,
        steps=steps,
        work=rows * cap,
        kind=ours_kind,
        planned=planned,
    )
    check.run(
        name,
        f"rollout {shape}, long tail (mean {mean})",
        "ours",
        ours_run(cap, lengths),
        tokens=sum(lengths),
        steps=steps,
        work=rows * mean,
        kind=ours_kind,
        planned=planned,
    )
    # warm-up at the same static-cache shape (rows stop after 4 tokens): compile is not timed
    check.run(
        name,
        f"rollout {shape}, warm-up (compile)",
        "transformers",
        hf_run([4] * rows),
        ours=False,
        work=rows * 4,
        kind=f"{name} hf compile",
        first_s=COMPILE_S,
    )
    check.run(
        name,
        f"rollout {shape}, forced",
        "transformers",
        hf_run(None),
        tokens=rows * cap,
        steps=cap,
        ours=False,
        work=rows * cap,
        kind=hf_kind,
    )
    check.run(
        name,
        f"rollout {shape}, long tail (mean {mean})",
        "transformers",
        hf_run(lengths),
        tokens=sum(lengths),
        steps=steps,
        ours=False,
        work=rows * cap,
        kind=hf_kind,
    )


def compile_settings(device: torch.device):
    """transformers' torch.compile settings for the anchor. On the CPU the dry run passes them too (the eager
    backend: transformers may skip compiling there), so it takes the branch the GPU run takes."""
    from transformers import CompileConfig

    return CompileConfig() if device.type == "cuda" else CompileConfig(backend="eager", mode=None)


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
        kind = f"{name} train {side}"
        model = check.run(
            name,
            f"{shape}: build",
            side,
            lambda: build(name, check.device.type),
            ours=side == "ours",
            work=1,
            kind=f"{name} build",
        )
        if model is None:
            continue
        ids, pad_mask = bench_model.random_batch(batch, seq, model.config.vocab_size, check.device)
        check.run(
            name,
            f"{shape}: warm-up step",
            side,
            lambda: step(model, ids, pad_mask),
            ours=side == "ours",
            work=batch * seq,
            kind=kind,
        )
        for _ in range(2):
            check.run(
                name,
                f"{shape}: step",
                side,
                lambda: step(model, ids, pad_mask),
                tokens=batch * seq,
                ours=side == "ours",
                work=batch * seq,
                kind=kind,
            )
        del model  # before the next side's is built


def check_model(check: Check, name: str, caps: list[int], tiny: bool) -> dict:
    torch.manual_seed(0)
    built = check.run(
        name,
        "build (random weights, LoRA r32)",
        "ours",
        lambda: bench_rollout.build_qwen3(name, check.device.type),
        work=1,
        kind="build",
    )
    if built is None:
        return {"built": False}
    hf, ours = built
    with_adapters(ours)
    weights_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    results = {"weights_bytes": weights_bytes, "parity": check_parity(check, name, ours, tiny)}
    for cap in caps:
        check_rollout(check, name, hf, ours, cap, tiny)
    del hf, ours, built
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
    plan = "" if row["planned_peak_bytes"] is None else f" (plan {row['planned_peak_bytes'] / 2**30:.2f})"
    status = "" if row["status"] == "ok" else row["status"][:70]
    return (
        f"{row['model']:<11} {row['phase']:<52} {row['side']:<20} {number(row['seconds'], '8.2f')} "
        f"{number(row['tokens_per_s'], '10,.0f')} {number(row['ms_per_step'], '8.2f')} {number(peak, '9.2f')}"
        f"{plan} {status}"
    )


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


HEADER = f"{'model':<11} {'phase':<52} {'side':<20} {'seconds':>8} {'tokens/s':>10} {'ms/step':>8} {'peak GiB':>9}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"directory for gpu_check.json (default: {DEFAULT_OUT})")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--models", nargs="+", choices=list(QWEN3), default=list(QWEN3))
    parser.add_argument("--caps", nargs="+", type=int, default=[512, 4096], help="max_new_tokens of the rollout runs")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="seconds the check may take; runs that would end later are skipped (default: 540)",
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen3 and caps of 8 and 16: a dry run")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu --tiny for a dry run)")
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s}: must be > 0")
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
        "budget_s": args.budget_s,
        "models": {},
        "rows": [],
    }
    print(
        f"{report['device']}, torch {report['torch']}, transformers {report['transformers']}, "
        f"peft {report['peft']}, budget {args.budget_s:.0f} s\n{HEADER}",
        flush=True,
    )
    check = Check(device, report, out_dir / "gpu_check.json", args.budget_s)
    for name in models:
        report["models"][name] = check_model(check, name, caps, args.tiny)
    report["ok"] = not check.failed
    report["skipped"] = sum(row["status"].startswith("skipped") for row in check.rows)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"\n{HEADER}\n" + "\n".join(format_row(row) for row in check.rows))
    print(
        f"\n{'ok' if report['ok'] else 'FAILED'} ({report['skipped']} runs skipped for the budget): "
        f"{out_dir / 'gpu_check.json'}"
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
