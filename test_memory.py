"""Tests for memory.py: the meta-device plan against the bytes counted in real CPU runs of a small model,
the extension from 2-3 blocks to the full depth, the presets' plans on 40 GB and 80 GB, fit's choices
and the errors when nothing fits."""

import dataclasses
import re

import pytest
import torch

import lora
import loss
import memory
import rollout
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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def test_plan_matches_a_real_cpu_rollout(small_model):
    """The planned sampler call against rollout.generate's. No stop id, so no row finishes: the CPU path
    then keeps every row, as the CUDA path always does."""
    planned = memory.Planner(SMALL, SMALL_WORK).measure("rollout", 2)[1]
    small_model.eval()
    with memory.LiveBytes() as tracker:
        out = rollout.generate(small_model, [list(range(1, 33)), list(range(5, 25))], samples_per_prompt=4,
                               max_new_tokens=C, temperature=1.0, stop_ids=[], seed=0)
    assert out.completion_ids.shape == (8, C)
    assert abs(planned - tracker.peak) / tracker.peak < 0.15, (planned, tracker.peak)


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
    cache = 2 * L * 8 * 128 * 2 * (ATR.prompt_len + 8 * 4096)  # k and v per prompt, bfloat16
    held, own = planner.measure("rollout", 8)
    assert 8 * cache <= own < 1.05 * 8 * cache  # the cache dominates a sampler call


def test_atr_preset_fits_a_40_gb_gpu():
    cfg = memory.model_config("Qwen/Qwen3-1.7B")
    chosen = memory.fit(cfg, ATR, 40 * memory.GB)
    # 8 prompts x 8 x 4096 tokens of cache (31 GB) next to 4 GB of weights and LoRA state: one call per step
    assert (chosen.rollout_prompts, chosen.eval_prompts) == (8, 8)
    assert 16 <= chosen.micro_batch_rows < 64
    text, fits = memory.report(cfg, chosen, 40 * memory.GB)
    assert fits and text.splitlines()[-1].startswith("plan: peak ") and text.endswith("of 40.0 GB (fits)")


def test_gppo_preset_fits_an_80_gb_gpu():
    cfg = memory.model_config("Qwen/Qwen3-8B")
    chosen = memory.fit(cfg, GPPO, 80 * memory.GB)
    # a prompt's 8 x 8192 tokens of cache take 9.7 GB: five of them fit next to 18 GB of weights and LoRA state
    assert (chosen.rollout_prompts, chosen.eval_prompts) == (5, 5)
    assert 4 <= chosen.micro_batch_rows < 32
    text, fits = memory.report(cfg, chosen, 80 * memory.GB)
    assert fits, text


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
    assert not fits  # 16 prompts x 8 x 4096 tokens of cache: 61 GB
    assert re.fullmatch(r"plan: peak 6[56]\.\d GB of 40\.0 GB \(does not fit: eval needs 6[56]\.\d GB; "
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
