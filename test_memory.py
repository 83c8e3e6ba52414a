"""Tests for memory.py: the meta-device plan against the bytes counted in real CPU runs of a small model,
the extension from 2-3 blocks to the full depth, the presets' plans on 40 GB and 80 GB, fit's choices
and the errors when nothing fits."""

import dataclasses
import re
from functools import partial

import pytest
import torch

import config
import lora
import loss
import memory
import rollout
import train
from model import ModelConfig, Transformer

SMALL = ModelConfig(vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=1024)
P, C = 32, 96  # prompt and completion tokens of the small runs
ROWS = 4
SMALL_WORK = memory.Workload(dtype=torch.float32, lora_rank=16, prompt_len=P, max_new_tokens=C, group_size=4,
                             prompts_per_step=2, rollout_prompts=2, micro_batch_rows=ROWS, eval_prompts=2, eval_k=4)
# The presets as train.py sets them (prompts of up to 512 tokens), entropy computed without autograd.
ATR = memory.Workload(lora_rank=32, prompt_len=512, max_new_tokens=4096, group_size=8, prompts_per_step=8,
                      rollout_prompts=8, micro_batch_rows=64, eval_prompts=30, eval_k=8, with_entropy=False,
                      eval_temperature=0.6)
GPPO = memory.Workload(lora_rank=32, prompt_len=512, max_new_tokens=8192, group_size=8, prompts_per_step=128,
                       updates_per_rollout=8, rollout_prompts=128, micro_batch_rows=128, eval_prompts=30, eval_k=8,
                       with_entropy=False, eval_temperature=0.6)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    model = Transformer(SMALL)
    lora.inject(model, SMALL_WORK.lora_rank, 32.0)
    return model


def test_live_bytes_counts_storages_once_and_forgets_freed_ones():
    with memory.LiveBytes() as tracker:
        x = torch.zeros(1000)  # 4000 bytes
        view = x[10:].view(10, 99)
        y = x * 2  # another 4000
        del y
        x.add_(1)  # in place: nothing new
    assert (tracker.live, tracker.peak) == (4000, 8000)
    del x, view
    assert tracker.live == 0


@pytest.mark.parametrize("checkpointing", [True, False])
def test_plan_matches_a_real_cpu_training_micro_batch(small_model, checkpointing):
    """The planned micro-batch (meta, surrogate loss) against the real one: padded rows, loss.policy_loss."""
    work = dataclasses.replace(SMALL_WORK, gradient_checkpointing=checkpointing)
    planned = memory.Planner(SMALL, work).measure("train", ROWS)[1]

    model = small_model
    model.gradient_checkpointing = checkpointing
    model.train()
    for p in lora.parameters(model):
        p.grad = torch.zeros_like(p)
    torch.manual_seed(1)
    prompt_lens, completion_lens = torch.tensor([32, 20, 32, 8]), torch.tensor([96, 50, 70, 96])
    with memory.LiveBytes() as tracker:
        ids = torch.randint(0, SMALL.vocab_size, (ROWS, P + C))
        position = torch.arange(P + C)
        pad = (position >= P - prompt_lens[:, None]) & (position < P + completion_lens[:, None])
        h = model.hidden(ids, pad)
        logp, _ = model.hidden_logprobs(h, ids, start=P, with_entropy=True)
        value, _ = loss.policy_loss(logp, -torch.rand(ROWS, C), torch.randn(ROWS), pad[:, P:], loss.LossConfig())
        value.backward()
    assert tracker.peak > 10**6
    assert abs(planned - tracker.peak) / tracker.peak < 0.15, (planned, tracker.peak)


def test_plan_matches_a_real_cpu_rollout():
    """The planned sampler call against rollout.generate's fixed-shape path (CUDA's, run eagerly) at its
    worst moment: half the rows stop at the last step that can compact, so the cache of the 4 rows kept
    is built while the cache of all 8 is alive. The stop ids are the tokens those rows draw there (a
    row's draws do not depend on the other rows), chosen among tokens no row drew earlier. Untied
    embeddings, as the tied small model keeps repeating its last token."""
    cfg = dataclasses.replace(SMALL, tie_word_embeddings=False)
    planned = memory.Planner(cfg, SMALL_WORK).measure("rollout", 2)[1]
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    prompts = [list(range(1, 33)), list(range(5, 25))]
    sample = partial(rollout.generate, model, prompts, samples_per_prompt=4, max_new_tokens=C,
                     temperature=1.0, seed=0, fixed_shapes=True)
    with memory.LiveBytes() as tracker:
        free_run = sample(stop_ids=[])
    assert free_run.completion_ids.shape == (8, C) and tracker.peak < planned

    last = C - 2
    earlier = set(free_run.completion_ids[:, :last].flatten().tolist())
    stops = [token for token in free_run.completion_ids[:, last].tolist() if token not in earlier][:4]
    with memory.LiveBytes() as tracker:
        out = sample(stop_ids=stops)
    assert (out.completion_mask.sum(1) == last + 1).sum() >= 4  # these rows stopped there: a compaction
    assert abs(planned - tracker.peak) / tracker.peak < 0.15, (planned, tracker.peak)


def test_advancing_many_steps_at_once_is_advance_repeated(small_model):
    caches = [small_model.new_cache(2, 40).fork(3) for _ in range(2)]
    alive = torch.tensor([True, False, True, True, True, False])
    for _ in range(5):
        caches[0].advance(alive)
    caches[1].advance(alive, 5)
    assert vars(caches[0]).keys() == vars(caches[1]).keys()
    for name, value in vars(caches[0]).items():
        other = vars(caches[1])[name]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name


def test_two_and_three_blocks_extend_exactly_to_the_full_depth():
    cfg = dataclasses.replace(SMALL, num_layers=6)
    planner = memory.Planner(cfg, SMALL_WORK)
    full = memory._MetaRun(memory.meta_model(cfg, SMALL_WORK), SMALL_WORK)
    for name, size in (("weights", 0), ("lora", 0), ("train", ROWS), ("rollout", 2)):
        assert planner.measure(name, size) == full.measure(name, size), name


def test_qwen3_1_7b_weights_and_kv_cache():
    cfg = memory.model_config("Qwen/Qwen3-1.7B")
    planner = memory.Planner(cfg, ATR)
    H, I, L, V = 2048, 6144, 28, 151936
    params = V * H + L * (2 * H * 16 * 128 + 2 * H * 8 * 128 + 3 * H * I + 2 * H + 2 * 128) + H  # tied head
    assert planner.peak("weights") == 2 * params  # bfloat16
    slot = 2 * L * 8 * 128 * 2  # k and v of one cache slot, bfloat16
    P, C, G = ATR.prompt_len, ATR.max_new_tokens, ATR.group_size
    full = 8 * (P + G * C) * slot  # 8 prompts, each prompt stored once and 8 rows of own tokens
    # the first compaction keeps 32 rows, each with its own copy of the prompt and room for every token,
    # while cache.select gathers one layer's [rows, kv, C - 2, D] block of own keys or values at a time
    compacted, gathered = 32 * (P + C) * slot, 32 * (C - 2) * slot // (2 * L)
    held, own = planner.measure("rollout", 8)
    assert full + compacted + gathered <= own < 1.05 * (full + compacted + gathered)  # the caches dominate


@pytest.mark.parametrize("preset, gpu_gb, chosen", [
    # 5 prompts x 8 x 4096 tokens of cache (19 GB) and the first compaction's second cache (8.5 GB)
    # next to 4 GB of weights and LoRA state
    ("atr-grpo-qwen3-1.7b", 40, dict(rollout_batch=5, grad_accum=2, eval_batch=5)),
    # 3 prompts x 8 x 8192 tokens of cache (29 GB) and the first compaction's 8-row cache (10 GB)
    # next to 18 GB of weights and LoRA state
    ("gppo-qwen3-8b", 80, dict(rollout_batch=3, grad_accum=12, eval_batch=3)),
])
def test_preset_plans_fit(preset, gpu_gb, chosen, capsys):
    cfg, _, _ = config.parse_args(["--preset", preset, "--plan", "--gpu-memory", str(gpu_gb)])
    assert train.plan(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "chosen: " + " ".join(f"--{name.replace('_', '-')} {value}" for name, value in chosen.items())
    assert re.fullmatch(rf"plan: peak \d+\.\d GB of {gpu_gb}\.0 GB \(fits\)", lines[-1])
    table = {line.split()[0]: line.split() for line in lines[2:8]}
    assert list(table) == ["weights", "lora", "train", "frozen", "rollout", "eval"]
    assert table["rollout"][3:6] == [str(chosen["rollout_batch"]), "prompts", "x"]
    usable = memory.usable_bytes(gpu_gb * memory.GB) / memory.GB
    assert all(0 < float(row[2]) <= usable for row in table.values())


def test_fit_takes_the_largest_sizes_that_fit():
    work = dataclasses.replace(SMALL_WORK, prompts_per_step=8, rollout_prompts=8)
    planner = memory.Planner(SMALL, work)
    usable = planner.peak("train", 2) + 1000  # room for micro-batches of 2 rows, not 3
    assert planner.peak("train", 3) > usable >= planner.peak("rollout", 8)
    chosen = memory.fit(SMALL, work, int((usable + memory.RESERVED) / (1 - memory.SLACK)) + 1)
    assert (chosen.micro_batch_rows, chosen.rollout_prompts, chosen.eval_prompts) == (2, 8, 2)


def test_largest_finds_the_boundary_of_a_convex_need():
    need = lambda size: max(100, 30 * size + 7 * (size // 5))  # flat, then steeper, not quite affine
    for usable in (100, 150, 999, 5000):
        expected = max(size for size in range(1, 65) if need(size) <= usable)
        assert memory._largest(need, 64, usable) == expected


def test_fit_names_the_phase_that_cannot_fit():
    with pytest.raises(ValueError, match=r"weights needs 16\.4 GB.*smaller model"):
        memory.fit(memory.model_config("Qwen/Qwen3-8B"), GPPO, 16 * memory.GB)
    work = dataclasses.replace(SMALL_WORK, group_size=64)  # a prompt's 64 x 96 tokens of cache outweigh training
    planner = memory.Planner(SMALL, work)
    usable = planner.peak("rollout", 1) - 1  # training fits; one prompt per sampler call does not
    assert planner.peak("train", 1) <= usable
    with pytest.raises(ValueError, match=r"rollout needs .* even at 1 row / prompt per call.*--group-size"):
        memory.fit(SMALL, work, int((usable + memory.RESERVED) / (1 - memory.SLACK)))


def test_report_says_what_does_not_fit():
    work = dataclasses.replace(ATR, micro_batch_rows=16, eval_prompts=16)
    text, fits = memory.report(memory.model_config("Qwen/Qwen3-1.7B"), work, 40 * memory.GB)
    assert not fits  # 16 prompts x 8 x 4096 tokens of cache (61 GB), then its first compaction (34 GB)
    assert re.fullmatch(r"plan: peak 99\.\d GB of 40\.0 GB \(does not fit: eval needs 99\.\d GB; "
                        r"lower --eval-batch \(prompts per evaluation call\)\)", text.splitlines()[-1])


def test_model_config(tiny_model_dir):
    assert memory.model_config(str(tiny_model_dir)).hidden_size == 32
    assert memory.model_config(None) == ModelConfig()
    base = memory.model_config("Qwen/Qwen3-8B-Base")
    assert (base.num_layers, base.max_position_embeddings, base.tie_word_embeddings) == (36, 32768, False)
    with pytest.raises(ValueError, match="not a known id"):
        memory.model_config("acme/NoSuchModel-1B")


def test_gpu_memory_bytes():
    assert memory.gpu_memory_bytes("cuda", 40) == 40 * memory.GB
    assert memory.gpu_memory_bytes("cpu", None) == 80 * memory.GB
    with pytest.raises(ValueError, match="--gpu-memory"):
        memory.gpu_memory_bytes(None, 0)


def test_the_full_parameter_preset_plans_each_of_8_ranks_on_80_gb(capsys):
    """gppo-qwen3-8b-full: every weight of Qwen3-8B-Base trained on 8 processes. The sharded phases run the
    real step under fully_shard over a fake world of 8 (fake tensors); the sizes are given, so fit measures
    little. Each rank holds an eighth of the fp32 weights, gradients and AdamW moments (16 bytes a parameter,
    132 GB in all), and for the rollout the whole model gathered in bf16."""
    cfg, _, _ = config.parse_args(["--preset", "gppo-qwen3-8b-full", "--plan", "--gpu-memory", "80",
                                   "--rollout-batch", "3", "--grad-accum", "2", "--eval-batch", "3"])
    assert cfg.world_size == 8 and cfg.lora_rank == 0 and cfg.lr == 1e-6
    assert train.plan(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["chosen: --rollout-batch 3 --grad-accum 2 --eval-batch 3", "per rank of 8 processes (FSDP2)"]
    table = {line.split()[0]: line.split() for line in lines[3:9]}
    assert list(table) == ["weights", "optimizer", "train", "frozen", "rollout", "eval"]
    shapes = [p.shape for p in memory.meta_model(memory.model_config("Qwen/Qwen3-8B-Base"),
                                                 memory.Workload(lora_rank=0)).parameters()]
    shard = sum(-(-s[0] // 8) * s[1:].numel() for s in shapes)  # FSDP2 pads dim 0 to a multiple of the ranks
    assert float(table["weights"][2]) == pytest.approx(4 * shard / memory.GB, abs=0.006)  # fp32 shards
    assert float(table["optimizer"][2]) >= 16 * shard / memory.GB  # weights, gradients, two moments
    whole_bf16 = 2 * sum(s.numel() for s in shapes) / memory.GB
    assert float(table["rollout"][2]) - float(table["rollout"][1]) > 12 * shard / memory.GB + whole_bf16
    assert re.fullmatch(r"plan: peak \d+\.\d GB of 80\.0 GB \(fits\)", lines[-1])
