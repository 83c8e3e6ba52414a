"""Rollout throughput: rollout.generate against transformers' generate on the same weights, in one run.

CPU (default): SmolLM2-135M-Instruct, 8 chat prompts x 4 samples, 64 new tokens, temperature 1.
GPU (--device cuda): Qwen3-1.7B and Qwen3-8B shapes with random bf16 weights, 32 prompts x 8 samples,
128-token prompts, 256 new tokens, temperature 1, against plain generate and against generate with a
static cache and torch.compile. --device meta only builds the GPU models, a check that runs anywhere.

Two length modes, the same on both sides, so both produce the same token count:
- forced (default): no stop tokens, every row runs to max_new_tokens;
- --long-tail: row i stops at a length drawn from a seeded log-normal capped at max_new_tokens
  (median cap/6, sigma 0.9: most rows end early, a few run to the cap), the shape of GRPO's completion
  lengths. A rare stop token (the last id) is forced at that length, so finished rows leave ours
  (compaction) and stay padded in transformers'.
--fixed-shapes runs our CUDA decode loop (span and row buckets) on the CPU.
--products times only the decode step's matrix products on the CPU: F.linear against the packed oneDNN product
engine/decode_weights.py runs (packed_linear) for every projection shape of SmolLM2-135M and Qwen3-1.7B (random
fp32 weights) at 1 to 32 rows: the measurements the CPU's choice follows; docs/engine.md keeps the table.
--profile prints the self CPU time by operator of one CPU call of each sampler, as shares of the call's (usable
on a shared machine, where seconds are not), and the minor page faults the call took.

    .venv/bin/python bench/rollout.py [--device cpu|cuda|meta] [--repeats 2] [--threads N] [--dtype bfloat16]
                                      [--models Qwen3-1.7B Qwen3-8B] [--long-tail] [--fixed-shapes] [--products]
                                      [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qwen3_shapes import QWEN3, QWEN3_COMMON, QWEN3_TINY  # noqa: E402

import model as modeling  # noqa: E402
import rollout  # noqa: E402
import sampling  # noqa: E402
from engine import decode_weights, memory  # noqa: E402
from engine.kv_cache import PagedRows, decode_step, prefill  # noqa: E402
from engine.pool import FLASH_BLOCK, Pool  # noqa: E402
from engine.scheduler import group_blocks  # noqa: E402
from infra import weights  # noqa: E402

long_tail_lengths = memory.long_tail_lengths  # the memory plan's length model

QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. "
    "Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. "
    "How much more money does Betty need to buy the wallet?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
    "What is 17 * 23 - 45?",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?",
    "Find the remainder when 2^10 is divided by 7.",
    "Albert buys 2 large pizzas and 2 small pizzas. A large pizza has 16 slices and a small pizza has 8 slices. "
    "If he eats it all, how many pieces does he eat that day?",
]


def timed(fn, device: torch.device):
    """(seconds, result) of fn()."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def ours_from_hf(hf_model) -> modeling.Transformer:
    """Our model sharing the Hugging Face model's weight tensors: same weights, no second copy."""
    cfg = modeling.ModelConfig.from_hf(hf_model.config.to_dict())
    with torch.device("meta"):
        ours = modeling.Transformer(cfg)
    ours.load_state_dict(hf_model.state_dict(), strict=True, assign=True)
    if cfg.tie_word_embeddings:
        ours.lm_head.weight = ours.model.embed_tokens.weight
    return ours.eval()


def left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


@contextlib.contextmanager
def forced_lengths(lengths: list[int] | None, stop_id: int):
    """Within the block, rollout.generate's row i draws stop_id as its lengths[i]-th token (all its work
    before that is done as usual). Rows are the output rows of one generate call."""
    if lengths is None:
        yield
        return
    draw = sampling.draw
    stop_at = torch.tensor(lengths + [0])  # the extra entry serves padding rows, which never stop
    on_device = {}  # copied to a device once: a copy per step would add a host sync to every timed step

    def forcing_draw(logits, *, rows, position, **kwargs):
        tokens, logp = draw(logits, rows=rows, position=position, **kwargs)
        if rows.device not in on_device:
            on_device[rows.device] = stop_at.to(rows.device)
        return tokens.masked_fill(on_device[rows.device][rows] == position + 1, stop_id), logp

    sampling.draw = forcing_draw
    try:
        yield
    finally:
        sampling.draw = draw


def hf_stop_processor(lengths: list[int], prompt_len: int, stop_id: int):
    """A transformers logits processor that makes row i emit stop_id as its lengths[i]-th new token."""

    def force(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        stop_now = torch.tensor(lengths, device=scores.device) == input_ids.shape[1] - prompt_len + 1
        forced = torch.full_like(scores, float("-inf"))
        forced[:, stop_id] = 0
        return torch.where(stop_now[:, None], forced, scores)

    return force


def hf_generate(
    hf_model, prompts, samples: int, new_tokens: int, pad_id: int, lengths: list[int] | None = None, **extra
) -> torch.Tensor:
    """transformers' sampling; rows run to new_tokens, or stop at `lengths` (one per row, prompt-major)."""
    from transformers import LogitsProcessorList

    ids, mask = left_padded(prompts, pad_id, hf_model.device)
    if lengths is None:
        stopping = dict(min_new_tokens=new_tokens)
    else:
        stop_id = hf_model.config.vocab_size - 1  # a rare token: the model itself seldom ends a row early
        force = hf_stop_processor(lengths, ids.shape[1], stop_id)
        stopping = dict(eos_token_id=stop_id, logits_processor=LogitsProcessorList([force]))
    out = hf_model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=samples,
        max_new_tokens=new_tokens,
        pad_token_id=pad_id,
        **stopping,
        **extra,
    )
    assert out.shape[0] == len(prompts) * samples and out.shape[1] <= ids.shape[1] + new_tokens, out.shape
    return out


def ours_generate(
    model, prompts, samples: int, new_tokens: int, lengths: list[int] | None = None, **extra
) -> rollout.Rollout:
    """rollout.generate; rows run to new_tokens, or stop at `lengths` (one per row, prompt-major)."""
    stop_id = model.config.vocab_size - 1  # a rare token: the model itself seldom ends a row early
    with forced_lengths(lengths, stop_id):
        out = rollout.generate(
            model,
            prompts,
            samples_per_prompt=samples,
            max_new_tokens=new_tokens,
            temperature=1.0,
            stop_ids=[] if lengths is None else [stop_id],
            seed=0,
            **extra,
        )
    expected = [new_tokens] * len(out.completions) if lengths is None else lengths
    assert all(n <= cap for n, cap in zip(out.completion_mask.sum(1).tolist(), expected))
    return out


def compare(runs: dict, tokens: int, device: torch.device, repeats: int) -> None:
    """Time each run `repeats` times, interleaved so load changes hit all alike; print each round's ratio of
    transformers' time to ours with the load average it began at (a shared machine's rounds differ), then
    the best tokens/s and what our sampler did (rollout.SamplerStats)."""
    best, stats = {name: float("inf") for name in runs}, None
    for round_ in range(repeats):
        load, seconds_of = os.getloadavg(), {}
        for name, fn in runs.items():
            seconds_of[name], out = timed(fn, device)
            best[name] = min(best[name], seconds_of[name])
            stats = out.stats if isinstance(out, rollout.Rollout) else stats
        ratio = seconds_of["transformers generate"] / seconds_of["rollout.generate"]
        print(f"round {round_ + 1}: ours is {ratio:.2f}x transformers generate (load average {load[0]:.1f})")
    ours = tokens / best["rollout.generate"]
    print(f"{'sampler':<34} {'seconds':>8} {'tokens/s':>10} {'ours is':>8}")
    for name, seconds in best.items():
        rate = tokens / seconds
        print(f"{name:<34} {seconds:>8.2f} {rate:>10.0f} {ours / rate:>7.2f}x")
    if stats is not None:
        print(
            f"rollout.generate: {stats.decode_steps} decode steps, {stats.prefills} prefills, rows in flight max "
            f"{stats.rows_max}, mean {stats.rows_mean:.1f}"
        )


CPU_PROMPTS, CPU_SAMPLES, CPU_NEW_TOKENS = 8, 4, 64


def chat_prompts(tokenizer, prompts_n: int) -> list[list[int]]:
    """The first prompts_n QUESTIONS as chat prompts of the tokenizer's template."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS[:prompts_n]
    ]


def bench_cpu(repeats: int, dtype: torch.dtype, long_tail: bool, fixed_shapes: bool) -> None:
    from transformers import AutoModelForCausalLM

    prompts_n, samples, new_tokens = CPU_PROMPTS, CPU_SAMPLES, CPU_NEW_TOKENS
    checkpoint = weights.resolve_checkpoint(None)
    tokenizer = weights.load_tokenizer(None)
    prompts = chat_prompts(tokenizer, prompts_n)
    ours = weights.from_pretrained(None, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).eval()
    pad_id = tokenizer.pad_token_id or 0
    device = torch.device("cpu")
    lengths = long_tail_lengths(prompts_n * samples, new_tokens) if long_tail else None
    mode = "forced length" if lengths is None else f"long tail (mean {sum(lengths) / len(lengths):.1f})"
    print(
        f"CPU, {torch.get_num_threads()} threads: SmolLM2-135M-Instruct {dtype}, {prompts_n} prompts "
        f"({min(map(len, prompts))}-{max(map(len, prompts))} tokens) x {samples} samples, "
        f"{new_tokens} new tokens, {mode}, temperature 1{', fixed shapes' if fixed_shapes else ''}"
    )
    ours_generate(ours, prompts, samples, 4)  # warm-up: first-call allocations
    hf_generate(hf, prompts, samples, 4, pad_id)
    runs = {
        "rollout.generate": lambda: ours_generate(
            ours, prompts, samples, new_tokens, lengths, fixed_shapes=fixed_shapes
        ),
        "transformers generate": lambda: hf_generate(hf, prompts, samples, new_tokens, pad_id, lengths),
    }
    if lengths is None:
        runs["our decode products alone"] = lambda: decode_products(ours, prompts_n * samples, new_tokens - 1)
    compare(runs, prompts_n * samples * new_tokens if lengths is None else sum(lengths), device, repeats)


def operator_shares(run, top: int = 16):
    """run() under torch.profiler: its self CPU time and the minor page faults it took, then each operator's share
    of that time, largest first, with its calls (top of them); returns what run returns. Shares hold on a shared
    machine, where seconds do not."""
    import resource

    from torch.profiler import ProfilerActivity, profile

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = run()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"self CPU time {total / 1e6:.2f} s (load average {os.getloadavg()[0]:.1f}), {faults} minor page faults")
    print(f"{'operator':<52} {'self CPU':>8} {'calls':>7}")
    for event in events[:top]:
        print(f"{event.key:<52} {100 * event.self_cpu_time_total / total:>7.1f}% {event.count:>7}")
    return out


def profile_cpu(dtype: torch.dtype, long_tail: bool) -> None:
    """operator_shares of one rollout.generate call and one transformers generate call in bench_cpu's setting
    (SmolLM2-135M-Instruct, 8 chat prompts x 4 samples, 64 new tokens), each after a warm-up call."""
    from transformers import AutoModelForCausalLM

    tokenizer = weights.load_tokenizer(None)
    prompts, samples, new_tokens = chat_prompts(tokenizer, CPU_PROMPTS), CPU_SAMPLES, CPU_NEW_TOKENS
    lengths = long_tail_lengths(CPU_PROMPTS * samples, new_tokens) if long_tail else None
    ours = weights.from_pretrained(None, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(weights.resolve_checkpoint(None), dtype=dtype).eval()
    pad_id = tokenizer.pad_token_id or 0
    print(
        f"CPU, {torch.get_num_threads()} threads: SmolLM2-135M-Instruct {dtype}, {CPU_PROMPTS} prompts x "
        f"{samples} samples, {new_tokens} new tokens, {'long tail' if long_tail else 'forced length'}"
    )
    ours_generate(ours, prompts, samples, 4)
    hf_generate(hf, prompts, samples, 4, pad_id)
    print("\nrollout.generate")
    stats = operator_shares(lambda: ours_generate(ours, prompts, samples, new_tokens, lengths)).stats
    print(f"({stats.decode_steps} decode steps, {stats.prefills} prefill passes)\n\ntransformers generate")
    operator_shares(lambda: hf_generate(hf, prompts, samples, new_tokens, pad_id, lengths))


@torch.inference_mode()
def decode_products(model, rows: int, steps: int) -> None:
    """Only the matrix products of `steps` of our decode steps, as decode_step runs them (DecodeWeights: each
    projection group's and the vocabulary projection, packed on the CPU in fp32) on [rows, in_features] inputs.
    Its time against our sampler's is the share of a call that is not the products: attention, norms, the draw,
    the prefill."""
    decode = decode_weights.DecodeWeights(model)
    widths = {group.modules[0].weight.shape[1] for group in decode.groups + [decode.vocabulary]}
    inputs = {n: torch.randn(rows, n, dtype=model.dtype) for n in widths}
    for _ in range(steps):
        for index, group in enumerate(decode.groups):
            decode.project(index, inputs[group.modules[0].weight.shape[1]])
        decode.logits(inputs[model.config.hidden_size])


PRODUCT_SHAPES = {  # (out, in) of each distinct projection, and how many of it one decode step runs
    "SmolLM2-135M": {(576, 576): 60, (192, 576): 60, (1536, 576): 60, (576, 1536): 30, (49152, 576): 1},
    "Qwen3-1.7B": {(2048, 2048): 56, (1024, 2048): 56, (6144, 2048): 56, (2048, 6144): 28, (151936, 2048): 1},
}
PRODUCT_ROWS = (1, 2, 4, 8, 16, 32)


@torch.no_grad()
def random_linears(shape: tuple[int, int], count: int) -> list[torch.nn.Linear]:
    """count bias-free linear layers of weight shape (out, in), random normal weights."""
    layers = [torch.nn.utils.skip_init(torch.nn.Linear, shape[1], shape[0], bias=False) for _ in range(count)]
    for layer in layers:
        layer.weight.normal_()
    return layers


@torch.inference_mode()
def bench_products(repeats: int) -> None:
    """Seconds of one decode step's matrix products, F.linear (MKL, the weight laid out again at every call)
    against packed_linear on each weight packed once for oneDNN (the decode step's CPU path), per shape and
    rows. Each shape runs on as many distinct random matrices as the model has of it, so the weights stream
    from memory as in a decode step, not from the cache. Best of `repeats` rounds, interleaved."""
    if not decode_weights.packs_weights(torch.device("cpu"), torch.float32):
        raise SystemExit("bench/rollout.py --products: this torch runs no packed oneDNN linear, nothing to compare")
    print(f"CPU, {torch.get_num_threads()} threads, fp32: one decode step's products, F.linear / packed in ms")
    torch.manual_seed(0)
    products = (
        lambda x, weight, packed: F.linear(x, weight),
        lambda x, weight, packed: decode_weights.packed_linear(x, packed),
    )
    for name, shapes in PRODUCT_SHAPES.items():
        print(f"{name:>14} rows " + "".join(f"{f'{o}x{i}':>20}" for o, i in shapes) + f"{'step':>20}")
        matrices = {  # (weight, its packed copy) pairs
            shape: [(m.weight, decode_weights.PackedWeights.of([m])) for m in random_linears(shape, count)]
            for shape, count in shapes.items()
        }
        for rows in PRODUCT_ROWS:
            cells, totals = [], [0.0, 0.0]
            for (_, in_features), pairs in matrices.items():
                x = torch.randn(rows, in_features)
                best = [float("inf"), float("inf")]
                for _ in range(repeats):
                    for side, product in enumerate(products):
                        seconds, _ = timed(lambda: [product(x, w, p) for w, p in pairs], torch.device("cpu"))
                        best[side] = min(best[side], seconds)
                totals = [total + b for total, b in zip(totals, best)]
                cells.append(best)
            print(
                f"{'':>14} {rows:>4} "
                + "".join(f"{1e3 * a:>8.1f} /{1e3 * b:>6.1f} {a / b:>3.1f}x" for a, b in cells)
                + f"{1e3 * totals[0]:>8.1f} /{1e3 * totals[1]:>6.1f} {totals[0] / totals[1]:>3.1f}x"
            )
        del matrices


def build_qwen3(name: str, device: str):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{**QWEN3_COMMON, **{**QWEN3, **QWEN3_TINY}[name]})
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    return hf, ours_from_hf(hf)


def bench_gpu(repeats: int, models: list[str], long_tail: bool) -> None:
    from transformers import CompileConfig

    prompts_n, samples, prompt_len, new_tokens = 32, 8, 128, 256
    lengths = long_tail_lengths(prompts_n * samples, new_tokens) if long_tail else None
    device = torch.device("cuda")
    for name in models:
        torch.manual_seed(0)
        hf, ours = build_qwen3(name, "cuda")
        prompts = torch.randint(1000, 100000, (prompts_n, prompt_len)).tolist()
        print(
            f"\n{torch.cuda.get_device_name()}: {name} random bf16 weights, {prompts_n} prompts x {samples} "
            f"samples, {prompt_len}-token prompts, {new_tokens} new tokens, "
            f"{'forced length' if lengths is None else 'long tail'}, temperature 1"
        )
        runs = {
            "rollout.generate": lambda: ours_generate(ours, prompts, samples, new_tokens, lengths),
            "transformers generate": lambda: hf_generate(hf, prompts, samples, new_tokens, 0, lengths),
            "transformers static cache+compile": lambda: hf_generate(
                hf,
                prompts,
                samples,
                new_tokens,
                0,
                lengths,
                cache_implementation="static",
                compile_config=CompileConfig(),
            ),
        }
        for fn in runs.values():  # warm-up: CUDA and cuBLAS set-up, torch.compile
            fn()
        compare(runs, prompts_n * samples * new_tokens if lengths is None else sum(lengths), device, repeats)
        del hf, ours, runs
        torch._dynamo.reset()  # drop the compiled graphs and their CUDA-graph memory before the next model
        torch.cuda.empty_cache()


@torch.inference_mode()
def build_on_meta(models: list[str]) -> None:
    """Build the GPU benchmark's models, prefill 4 prompts into a KV pool and run one decode step over
    their 4 x 4 rows on the meta device (shapes only), with LoRA on every projection as the trainer has."""
    import lora

    meta = torch.device("meta")
    for name in models:
        hf, ours = build_qwen3(name, "meta")
        lora.inject(ours, 32, 64.0)
        pool = Pool(ours, 1 + 4 * group_blocks(128, 4, 256, FLASH_BLOCK), max_len=128 + 256)
        table = torch.ones(4, pool.table_width, dtype=torch.int32, device=meta)
        prefill(
            ours,
            torch.zeros(4, 128, dtype=torch.long, device=meta),
            torch.ones(4, 128, dtype=torch.bool, device=meta),
            PagedRows(pool.kv, table, torch.zeros(4, dtype=torch.long, device=meta)),
        )
        rows = PagedRows(pool.kv, table.repeat_interleave(4, 0), torch.full((16,), 128, device=meta))
        logits = decode_step(
            ours, torch.zeros(16, dtype=torch.long, device=meta), rows, pool.block_size, pool.decode_weights()
        )
        assert logits.shape == (16, ours.config.vocab_size)
        params = sum(p.numel() for p in ours.parameters())
        print(
            f"{name}: built on meta, {params / 1e9:.2f}B {ours.dtype} parameters with LoRA, "
            f"{ours.config.num_layers} layers; {pool.attention} attention over {pool.block_size}-slot blocks; "
            f"decode_step logits {tuple(logits.shape)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--device", choices=["cpu", "cuda", "meta"], default="cpu")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per sampler; the best one counts")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="CPU weights")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(QWEN3),
        default=list(QWEN3),
        help="GPU and meta: which Qwen3 shapes (one at a time fits a short device session)",
    )
    parser.add_argument("--long-tail", action="store_true", help="rows stop at seeded log-normal lengths")
    parser.add_argument("--fixed-shapes", action="store_true", help="CPU: run our CUDA decode loop")
    parser.add_argument(
        "--products",
        action="store_true",
        help="CPU: time only the decode step's matrix products, packed against F.linear",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="CPU: self CPU time by operator of one call of each sampler, as shares, and its page faults",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        bench_gpu(args.repeats, args.models, args.long_tail)
    elif args.products:
        bench_products(args.repeats)
    elif args.profile:
        profile_cpu(getattr(torch, args.dtype), args.long_tail)
    elif args.device == "meta":
        build_on_meta(args.models)
    else:
        bench_cpu(args.repeats, getattr(torch, args.dtype), args.long_tail, args.fixed_shapes)


if __name__ == "__main__":
    main()
