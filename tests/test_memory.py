"""Tests for memory.py: the meta-device plan against the bytes counted in real CPU runs of a small model,
the extension from 2-3 blocks to the full depth, the KV pool, the presets' plans on 40 GB and 80 GB (and
their rollout estimates against the calls before the pool), fit's choices, the simulation of continuous
batching and the errors when nothing fits."""

import dataclasses
import random
import re

import pytest
import torch

import config
import lora
import loss
import rollout
from engine import counting, decode_weights, memory, sampler, sizes
from engine.pool import Pool
from engine.scheduler import Group, SamplerStats, Scheduler, group_blocks
from engine.shared_prompts import hidden_shared
from model import ModelConfig, Transformer

SMALL = ModelConfig(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
)
P, C = 32, 96  # prompt and completion tokens of the small runs
ROWS = 4
SMALL_WORK = memory.Workload(
    dtype=torch.float32,
    lora_rank=16,
    prompt_len=P,
    max_new_tokens=C,
    group_size=4,
    prompts_per_step=2,
    rollout_prompts=2,
    micro_batch_rows=ROWS,
    eval_prompts=2,
    eval_k=4,
)
# The presets as train.py sets them (prompts of up to 512 tokens), entropy computed without autograd.
ATR = memory.Workload(
    lora_rank=32,
    prompt_len=512,
    max_new_tokens=4096,
    group_size=8,
    prompts_per_step=8,
    rollout_prompts=8,
    micro_batch_rows=64,
    eval_prompts=30,
    eval_k=8,
    with_entropy=False,
    eval_temperature=0.6,
)
GPPO = memory.Workload(
    lora_rank=32,
    prompt_len=512,
    max_new_tokens=8192,
    group_size=8,
    prompts_per_step=128,
    updates_per_rollout=8,
    rollout_prompts=128,
    micro_batch_rows=128,
    eval_prompts=30,
    eval_k=8,
    with_entropy=False,
    eval_temperature=0.6,
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def atr_planner():
    """The Qwen3-1.7B plan of ATR, shared by the tests that only read its phases."""
    return memory.Planner(memory.model_config("Qwen/Qwen3-1.7B"), ATR)


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    model = Transformer(SMALL)
    lora.inject(model, SMALL_WORK.lora_rank, 32.0)
    return model


def test_live_bytes_counts_storages_once_and_forgets_freed_ones():
    with counting.LiveBytes() as tracker:
        x = torch.zeros(1000)  # 4000 bytes
        view = x[10:].view(10, 99)
        y = x * 2  # another 4000
        del y
        x.add_(1)  # in place: nothing new
    assert (tracker.live, tracker.peak) == (4000, 8000)
    del x, view
    assert tracker.live == 0


def test_a_view_counts_nothing_however_often_it_runs():
    """aten._unsafe_view returns its input's storage without saying so in its schema: the layout memo must not
    hand out a new storage for it on a second call with the same layout."""
    x = torch.zeros(4, 8, device="meta")
    for _ in range(2):
        with counting.LiveBytes() as tracker:
            y = torch.ops.aten._unsafe_view(x, (32,))
            z = x * 2  # 128 bytes of its own
        assert (tracker.peak, y.untyped_storage().nbytes(), z.shape) == (128, 128, (4, 8))


def ready_to_train(model, checkpointing: bool):
    """The model in training mode with zero gradients already allocated (as after a first micro-batch), seeded."""
    model.gradient_checkpointing = checkpointing
    model.train()
    for p in lora.parameters(model):
        p.grad = torch.zeros_like(p)
    torch.manual_seed(1)
    return model


@pytest.mark.parametrize("checkpointing", [True, False])
def test_plan_matches_a_real_cpu_training_micro_batch(small_model, checkpointing):
    """The planned micro-batch (meta, surrogate loss) against the real one: padded rows, loss.policy_loss."""
    work = dataclasses.replace(SMALL_WORK, gradient_checkpointing=checkpointing)
    planned = memory.Planner(SMALL, work).measure("train", ROWS)[1]

    model = ready_to_train(small_model, checkpointing)
    prompt_lens, completion_lens = torch.tensor([32, 20, 32, 8]), torch.tensor([96, 50, 70, 96])
    with counting.LiveBytes() as tracker:
        ids = torch.randint(0, SMALL.vocab_size, (ROWS, P + C))
        position = torch.arange(P + C)
        pad = (position >= P - prompt_lens[:, None]) & (position < P + completion_lens[:, None])
        h = model.hidden(ids, pad)
        logp, _ = model.hidden_logprobs(h, ids, start=P, with_entropy=True)
        value, _ = loss.policy_loss(logp, -torch.rand(ROWS, C), torch.randn(ROWS), pad[:, P:], loss.LossConfig())
        value.backward()
    assert tracker.peak > 10**6
    assert abs(planned - tracker.peak) / tracker.peak < 0.15, (planned, tracker.peak)


@pytest.mark.parametrize("new_tokens", [C, 48])  # keys and values copied per query head; heads folded
def test_plan_matches_a_real_cpu_micro_batch_of_one_prompt_group(small_model, new_tokens):
    """--shuffle groups: a micro-batch of one prompt's 4 rows, its prompt run once (hidden_shared)."""
    work = dataclasses.replace(SMALL_WORK, shuffle="groups", max_new_tokens=new_tokens)
    assert memory.prompts_per_pass(work, ROWS, "train") == [1]
    planned = memory.Planner(SMALL, work).measure("train", ROWS)[1]
    model = ready_to_train(small_model, True)
    lengths = torch.tensor([new_tokens, 50, 7, new_tokens - 1])
    with counting.LiveBytes() as tracker:
        prompt_ids = torch.randint(0, SMALL.vocab_size, (1, P))
        prompt_mask = torch.arange(P)[None] >= 6
        completion_ids = torch.randint(0, SMALL.vocab_size, (ROWS, new_tokens))
        mask = torch.arange(new_tokens)[None] < lengths[:, None]
        h = hidden_shared(model, prompt_ids, prompt_mask, torch.zeros(ROWS, dtype=torch.long), completion_ids, mask)
        ids = torch.cat([prompt_ids[:, -1:].expand(ROWS, 1), completion_ids], 1)
        logp, _ = model.hidden_logprobs(h, ids, start=1, with_entropy=True)
        value, _ = loss.policy_loss(logp, -torch.rand(ROWS, new_tokens), torch.randn(ROWS), mask, loss.LossConfig())
        value.backward()
    assert tracker.peak > 10**6
    assert abs(planned - tracker.peak) / tracker.peak < 0.15, (planned, tracker.peak)


@pytest.mark.parametrize(
    "shuffle, rows, layouts",
    [
        ("rows", 1, [1]),
        ("rows", 3, [3, 2]),
        ("rows", 8, [8, 7]),
        ("rows", 12, [8]),  # 8 prompts of 4 rows
        ("groups", 1, [1]),
        ("groups", 2, [2, 1]),
        ("groups", 4, [1]),
        ("groups", 6, [3]),
        ("groups", 16, [4]),
    ],
)
def test_a_pass_is_planned_at_every_layout_that_can_be_largest(shuffle, rows, layouts):
    """Rows drawn one by one may all have prompts of their own (each runs whole) or all but two; in whole
    groups, consecutive rows span rows / 4 prompts, or one more when they start inside a group."""
    work = dataclasses.replace(SMALL_WORK, prompts_per_step=8, shuffle=shuffle)
    assert memory.prompts_per_pass(work, rows, "train") == layouts
    assert memory.prompts_per_pass(
        dataclasses.replace(work, shuffle="groups"), rows, "frozen"
    ) == memory.prompts_per_pass(dataclasses.replace(work, shuffle="groups"), rows, "train")


def test_automatic_micro_batches_count_a_shared_prompt_once():
    """fit's micro-batches hold TRAIN_TOKENS tokens as the pass runs them: 8 rows of 2 prompts of 96 tokens
    with 16 new each run 2 x 96 + 8 x 16 tokens in whole groups, and 8 x 112 drawn one by one from 8 prompts."""
    work = dataclasses.replace(SMALL_WORK, prompt_len=96, max_new_tokens=16, prompts_per_step=8)
    groups = dataclasses.replace(work, shuffle="groups")
    assert memory.pass_tokens(work, 8) == 8 * 112 and memory.pass_tokens(groups, 8) == 2 * 96 + 8 * 16
    assert memory.pass_tokens(work, 12) == 8 * 96 + 12 * 16  # 12 rows of 8 prompts: at most 8 prompts
    assert memory.pass_tokens(groups, 1) == 112  # one row alone runs whole


def test_a_pass_of_whole_groups_plans_less_memory_than_rows_alone():
    """The demo's shape: long prompts, short completions; 8 rows of 2 prompts hold 320 tokens, not 896."""
    work = dataclasses.replace(
        SMALL_WORK,
        prompt_len=96,
        max_new_tokens=16,
        gradient_checkpointing=False,
        prompts_per_step=8,
        micro_batch_rows=8,
        recompute_old_logp=True,
    )
    by_rows, by_groups = (
        memory.Planner(SMALL, dataclasses.replace(work, shuffle=shuffle)) for shuffle in ("rows", "groups")
    )
    assert by_groups.measure("train", 8)[1] < 0.6 * by_rows.measure("train", 8)[1]
    assert by_groups.measure("frozen", 8)[1] < by_rows.measure("train", 8)[1]


def test_plan_matches_a_real_cpu_rollout(monkeypatch):
    """The planned sampler call against rollout.generate's fixed-shape path (CUDA's, run eagerly) over a pool
    made beforehand (the pool is resident: the plan counts it apart), every row running to the cap. With
    graphs the plan adds what they hold: the static logits of two row buckets and the step's temporaries. As on
    CUDA, the products read the parameters: the CPU's packed copy of them is not made."""
    monkeypatch.setattr(decode_weights, "packs_weights", lambda device, dtype: False)
    cfg = dataclasses.replace(SMALL, tie_word_embeddings=False)
    run = memory._MetaRun(memory.meta_model(cfg, SMALL_WORK), SMALL_WORK)
    with counting.flash_attention_on_meta():
        planned = memory.sampling_phase(run.model, SMALL_WORK, 2, graphs=False)
        with_graphs = memory.sampling_phase(run.model, SMALL_WORK, 2)
    assert with_graphs - planned >= 2 * 8 * cfg.vocab_size * 4  # logits [8 + 4, V] fp32, and the step's temporaries
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    lora.inject(model, SMALL_WORK.lora_rank, 32.0)
    prompts = [list(range(1, 33)), list(range(5, 25))]
    pool = Pool(model, 200, max_len=P + C)
    with counting.LiveBytes() as tracker:
        out = rollout.generate(
            model,
            prompts,
            samples_per_prompt=4,
            max_new_tokens=C,
            temperature=1.0,
            seed=0,
            stop_ids=[],
            fixed_shapes=True,
            pool=pool,
        )
    assert out.completion_ids.shape == (8, C)
    assert abs(planned - tracker.peak) / tracker.peak < 0.15, (planned, tracker.peak)


def test_two_and_three_blocks_extend_exactly_to_the_full_depth():
    cfg = dataclasses.replace(SMALL, num_layers=6)
    planner = memory.Planner(cfg, SMALL_WORK)
    full = memory._MetaRun(memory.meta_model(cfg, SMALL_WORK), SMALL_WORK)
    for name, size in (("weights", 0), ("lora", 0), ("train", ROWS), ("rollout", 2)):
        assert planner.measure(name, size) == full.measure(name, size), name


def test_qwen3_1_7b_weights_and_kv_pool(atr_planner):
    planner = atr_planner
    H, I, L, V = 2048, 6144, 28, 151936
    params = V * H + L * (2 * H * 16 * 128 + 2 * H * 8 * 128 + 3 * H * I + 2 * H + 2 * 128) + H  # tied head
    assert planner.peak("weights") == 2 * params  # bfloat16
    # bf16 plans FlashAttention's paged kernel: blocks of 256 slots, k and v of 8 heads x 128 in 28 layers
    assert planner.block_size == 256 and planner.block_bytes == 2 * L * 256 * 8 * 128 * 2
    held, own = planner.held_and_own("pool", 0, 101)
    assert own == 101 * planner.block_bytes and held == planner.peak("lora")
    assert planner.peak("train", 4, 101) == planner.peak("train", 4) + own  # resident through every later phase
    # one group of 8 rows of a 512-token prompt at 4,096 new tokens: 2 shared blocks, 8 x 16 own
    assert planner.floor_blocks(ATR) == 1 + 2 + 8 * 16


def long_tail_passes_before(work: memory.Workload, prompts_per_call: int) -> int:
    """Decode passes of the sampler before the pool: calls of prompts_per_call prompts, each as long as its
    longest row, for the plan's length model."""
    rows = prompts_per_call * work.group_size
    lengths = memory.long_tail_lengths(work.step_rows, work.max_new_tokens)
    return sum(max(lengths[lo : lo + rows]) for lo in range(0, len(lengths), rows))


@pytest.mark.parametrize(
    "preset, gpu_gb, chosen, before_calls, rows_at_least, fewer_passes",
    [
        # the whole step in flight at once, in a pool of 948 blocks (28 GB) beside micro-batches packed up to 2
        # rows at full length; its passes are the longest row's (4,095), against 4 calls of 5 prompts before
        (
            "atr-grpo-qwen3-1.7b",
            40,
            dict(rollout_batch=16, grad_accum=16, micro_batch_tokens=9216, eval_batch=16, kv_blocks=949),
            5,
            128,
            3,
        ),
        # up to 32 prompts x 8 in flight over 1,276 blocks (48 GB) beside micro-batches packed up to 1 row at full
        # length, against 43 calls of 3 prompts before
        (
            "gppo-qwen3-8b",
            80,
            dict(rollout_batch=32, grad_accum=128, micro_batch_tokens=8704, eval_batch=32, kv_blocks=1277),
            3,
            150,
            5,
        ),
    ],
)
def test_preset_plans_fit(preset, gpu_gb, chosen, before_calls, rows_at_least, fewer_passes, capsys):
    cfg, _, _ = config.parse_args(["--preset", preset, "--plan", "--gpu-memory", str(gpu_gb)])
    assert sizes.plan(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "chosen: " + " ".join(f"--{name.replace('_', '-')} {value}" for name, value in chosen.items())
    assert re.fullmatch(rf"plan: peak \d+\.\d GB of {gpu_gb}\.0 GB \(fits\)", lines[-1])
    table = {line.split()[0]: line.split() for line in lines[2:9]}
    assert list(table) == ["weights", "lora", "pool", "train", "frozen", "rollout", "eval"]
    usable = memory.usable_bytes(gpu_gb * memory.GB) / memory.GB
    assert all(0 < float(row[2]) <= usable for row in table.values())
    estimate = re.search(r"rows in flight max (\d+), mean (\d+); ([\d,]+) decode passes", lines[9])
    rows_max, passes = int(estimate[1]), int(estimate[3].replace(",", ""))
    before = long_tail_passes_before(sizes.workload(cfg), before_calls)  # the calls the plan chose before
    assert rows_max >= rows_at_least and passes <= before / fewer_passes, (rows_max, passes, before)
    # packed micro-batches: fewer than half the passes of the plan's rows for the same lengths
    training = re.fullmatch(
        r"training estimate, .*: ([\d,]+) micro-batch(?:es)? .* \(by rows ([\d,]+) of .*", lines[10]
    )
    packed, by_rows = (int(training[i].replace(",", "")) for i in (1, 2))
    assert by_rows == cfg.updates_per_rollout * chosen["grad_accum"] and packed < by_rows / 2, (packed, by_rows)


def test_the_plan_counts_old_hidden_and_the_evaluation_prompts(atr_planner):
    cfg, planner = memory.model_config("Qwen/Qwen3-1.7B"), atr_planner
    with_hidden = memory.Planner(cfg, dataclasses.replace(ATR, old_hidden=True))
    # kl_full keeps the sampling policy's final states [N, C, hidden] in bf16 through the step
    grown = with_hidden.peak("train", 4) - planner.peak("train", 4)
    assert grown >= ATR.step_rows * ATR.max_new_tokens * 2048 * 2
    rule = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b", "--rule", "kl_full"])[0]
    plain = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b"])[0]
    assert sizes.workload(rule).old_hidden and not sizes.workload(plain).old_hidden
    longer_eval = dataclasses.replace(ATR, eval_prompt_len=1500)
    longer = memory.Planner(cfg, longer_eval)
    assert longer.floor_blocks(longer_eval) > planner.floor_blocks(ATR)
    assert longer.peak("eval", 30) > planner.peak("eval", 30)


def test_an_evaluation_call_is_measured_at_the_size_asked(atr_planner):
    """fit tries --eval-batch sizes other than the workload's (30 here): a call of more prompts holds more rows,
    results and logits, whatever the planner was built with."""
    own = [atr_planner.measure("eval", size)[1] for size in (15, 30, 60)]
    assert own[0] < own[1] < own[2], own


def test_fit_gives_the_pool_what_the_other_phases_leave():
    work = dataclasses.replace(SMALL_WORK, prompts_per_step=8, rollout_prompts=8, micro_batch_rows=8)
    planner = memory.Planner.of(SMALL, work)  # the one fit's planning() finds
    budget = 2 * 10**9
    chosen = memory.fit(SMALL, work, budget)
    usable = memory.usable_bytes(budget)
    # training micro-batches of the fewest rows holding TRAIN_TOKENS tokens; the pool fills the rest
    assert chosen.micro_batch_rows == min(work.minibatch_rows, -(-memory.TRAIN_TOKENS // (P + C)))
    peaks = {name: planner.peak(name, size, chosen.pool_blocks) for name, size in memory.phase_sizes(chosen).items()}
    assert max(peaks.values()) <= usable < max(peaks.values()) + planner.block_bytes
    kept = memory.fit(SMALL, work, budget, free=("rollout_prompts",))  # --grad-accum and --eval-batch given
    assert (kept.micro_batch_rows, kept.eval_prompts) == (work.micro_batch_rows, work.eval_prompts)


def test_simulation_of_continuous_batching():
    """Three groups in a pool that holds two at full length. With max_rows of two groups, the third waits for
    one to finish; without, it is admitted at once and, every row running to the cap, preempted and
    sampled again; when the first two groups' rows end early, it runs beside them."""
    G, C, bs = 4, 64, 16
    blocks = 1 + 2 * group_blocks(16, G, C, bs) + 8
    waits = memory.simulate_rollout([16] * 3, G, [C] * 12, blocks, bs, 8, C)
    assert (waits.rows_max, waits.preempted, waits.decode_steps) == (8, 0, 2 * (C - 1))
    preempts = memory.simulate_rollout([16] * 3, G, [C] * 12, blocks, bs, 12, C)
    assert (preempts.rows_max, preempts.preempted, preempts.decode_steps) == (12, 1, 2 * (C - 1))
    joins = memory.simulate_rollout([16] * 3, G, [8] * 8 + [C] * 4, blocks, bs, 12, C)
    assert (joins.rows_max, joins.preempted, joins.decode_steps) == (12, 0, C - 1)


def stepwise_rollout(prompt_lens, G, lengths, blocks, block_size, max_rows, new_tokens, chunk) -> SamplerStats:
    """simulate_rollout without its jumps: the Scheduler synced after every chunk, as the sampler's loop does."""
    sched = Scheduler(blocks - 1, block_size, chunk, max_rows, new_tokens)
    for i, prompt_len in enumerate(prompt_lens):
        sched.add(Group(i, prompt_len, list(range(G))))
    stats = SamplerStats()
    while True:
        sched.finish([row for row in sched.running if row.position >= lengths[row.out_row(G)]])
        preempted, admitted = sched.sync()
        stats.preempted += len(preempted)
        stats.prefills += len(sampler.prefill_batches(admitted))
        if not sched.running:
            return stats
        steps = sched.chunk_steps()
        stats.decode_steps += steps
        stats.row_steps += steps * len(sched.running)
        stats.rows_max = max(stats.rows_max, len(sched.running))
        sched.advance(steps)


def test_the_simulation_jumps_only_over_syncs_that_decide_nothing():
    """Random pools, prompts, lengths and chunks: the counts of simulate_rollout are those of syncing at every
    chunk (preemptions, waits for the watermark and for max_rows included)."""
    rng = random.Random(0)
    for _ in range(150):
        bs, chunk, G, new_tokens = (
            rng.choice([2, 8, 32]),
            rng.choice([1, 3, 16]),
            rng.choice([1, 2, 4]),
            rng.randint(1, 150),
        )
        prompt_lens = [rng.randint(1, 100) for _ in range(rng.randint(1, 8))]
        lengths = [rng.choice([rng.randint(1, new_tokens), new_tokens]) for _ in range(len(prompt_lens) * G)]
        floor = 1 + max(group_blocks(p, G, new_tokens, bs) for p in prompt_lens)
        blocks = floor + rng.choice([0, 2, rng.randint(0, 4 * floor)])
        max_rows = rng.choice([G, rng.randint(G, len(prompt_lens) * G), 10**6])
        case = (prompt_lens, G, lengths, blocks, bs, max_rows, new_tokens, chunk)
        assert memory.simulate_rollout(*case) == stepwise_rollout(*case), case


def test_fit_names_what_cannot_fit():
    with pytest.raises(ValueError, match=r"weights needs 16\.4 GB.*smaller model"):
        memory.fit(memory.model_config("Qwen/Qwen3-8B"), GPPO, 16 * memory.GB)
    work = dataclasses.replace(SMALL_WORK, group_size=64)  # a prompt's 64 rows x 127 slots outweigh training
    planner = memory.Planner.of(SMALL, work)  # the one fit's planning() finds
    budget = int((planner.peak("train", 1) + memory.RESERVED) / (1 - memory.SLACK)) + 10**6
    with pytest.raises(
        ValueError,
        match=r"with the smallest pool \(\d+ blocks: one group of 64 rows at full "
        r"length\).*--max-new-tokens",
    ):
        memory.fit(SMALL, work, budget)


def test_report_says_what_does_not_fit():
    work = dataclasses.replace(ATR, micro_batch_rows=64, pool_blocks=900)
    text, fits = memory.report(memory.model_config("Qwen/Qwen3-1.7B"), work, 40 * memory.GB)
    assert not fits  # 64 rows x 4,608 tokens of training beside a 27 GB pool
    assert re.fullmatch(
        r"plan: peak \d+\.\d GB of 40\.0 GB \(does not fit: train needs \d+\.\d GB; "
        r"raise --grad-accum \(fewer rows per micro-batch\)\)",
        text.splitlines()[-1],
    )


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


def test_a_full_run_on_one_process_sizes_its_pool_beside_the_optimizer_state(capsys):
    """ATR's 1.7B setup with every weight trained on one 80 GB GPU: the fp32 gradients and moments (34 GB) are
    resident when the kept pool is, so the pool is sized against the optimizer step as well as the passes."""
    cfg, _, _ = config.parse_args(
        ["--preset", "atr-grpo-qwen3-1.7b", "--lora-rank", "0", "--plan", "--gpu-memory", "80"]
    )
    assert sizes.plan(cfg)
    lines = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line.split() for line in lines[3:10]}
    usable = memory.usable_bytes(80 * memory.GB) / memory.GB
    assert float(table["optimizer"][1]) > 30 and float(table["pool"][2]) <= usable + 0.005
    assert float(table["pool"][2]) >= max(float(table[name][2]) for name in ("train", "frozen", "rollout"))


def test_the_full_parameter_preset_plans_each_of_8_ranks_on_80_gb(capsys):
    """gppo-qwen3-8b-full: every weight of Qwen3-8B-Base trained on 8 processes. The sharded phases run the
    real step under fully_shard over a fake world of 8 (fake tensors); the sizes are given, so fit measures
    little. Each rank holds an eighth of the fp32 weights, gradients and AdamW moments (16 bytes a parameter,
    132 GB in all), and for the rollout the whole model gathered in bf16."""
    cfg, _, _ = config.parse_args(
        [
            "--preset",
            "gppo-qwen3-8b-full",
            "--plan",
            "--gpu-memory",
            "80",
            "--rollout-batch",
            "3",
            "--grad-accum",
            "4",
            "--eval-batch",
            "3",
        ]
    )
    assert cfg.world_size == 8 and cfg.lora_rank == 0 and cfg.lr == 1e-6
    assert sizes.plan(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"chosen: --rollout-batch 3 --grad-accum 4 --eval-batch 3 --kv-blocks \d+", lines[0])
    assert lines[1] == "per rank of 8 processes (FSDP2)"
    table = {line.split()[0]: line.split() for line in lines[3:10]}
    assert list(table) == ["weights", "optimizer", "pool", "train", "frozen", "rollout", "eval"]
    shapes = [
        p.shape
        for p in memory.meta_model(memory.model_config("Qwen/Qwen3-8B-Base"), memory.Workload(lora_rank=0)).parameters()
    ]
    shard = sum(-(-s[0] // 8) * s[1:].numel() for s in shapes)  # FSDP2 pads dim 0 to a multiple of the ranks
    assert float(table["weights"][2]) == pytest.approx(4 * shard / memory.GB, abs=0.006)  # fp32 shards
    assert float(table["optimizer"][2]) >= 16 * shard / memory.GB  # weights, gradients, two moments
    whole_bf16 = 2 * sum(s.numel() for s in shapes) / memory.GB
    assert float(table["rollout"][2]) - float(table["rollout"][1]) > 12 * shard / memory.GB + whole_bf16
    assert re.fullmatch(r"plan: peak \d+\.\d GB of 80\.0 GB \(fits\)", lines[-1])


def test_the_dapo_preset_plans_each_of_8_ranks_on_80_gb(capsys):
    """dapo-qwen2.5-7b: every weight of Qwen2.5-7B on 8 processes, each rank's 64 prompts x 16 at up to 20,480 new
    tokens, dynamic sampling of up to 30 calls. The sizes are given, so fit measures little. The last call finds
    the 29 earlier calls' rollouts of the rank's 1,024 rows held: the rollout phase holds them beside what the
    evaluation call finds resident."""
    sized = ("--rollout-batch", "16", "--grad-accum", "64", "--eval-batch", "16")
    cfg, _, _ = config.parse_args(["--preset", "dapo-qwen2.5-7b", "--plan", "--gpu-memory", "80", *sized])
    assert cfg.world_size == 8 and cfg.lora_rank == 0 and cfg.dynamic_sampling == 30
    assert sizes.plan(cfg)
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"chosen: --rollout-batch 16 --grad-accum 64 --eval-batch 16 --kv-blocks \d+", lines[0])
    assert lines[1] == "per rank of 8 processes (FSDP2)"
    table = {line.split()[0]: line.split() for line in lines[3:10]}
    rows, prompt, new = 64 * 16, 512, 20480
    earlier = 29 * rows * ((prompt + new) * 9 + new * (8 + 4 + 1)) / memory.GB
    held = {name: float(table[name][2]) - float(table[name][1]) for name in ("rollout", "eval")}
    assert held["rollout"] - held["eval"] == pytest.approx(earlier, rel=0.01)
    assert re.fullmatch(r"plan: peak \d+\.\d GB of 80\.0 GB \(fits\)", lines[-1])


def test_dapo_s_own_model_does_not_fit_one_node_of_8_x_80_gb():
    """Qwen2.5-32B at the dapo preset's batch and lengths, one of 8 ranks: trained in full, the rank's fp32 shards
    and optimizer state alone pass what the plan may fill of 80 GB; with LoRA, its bf16 weights and the smallest
    pool that samples (one group of 16 rows at 512 + 20,480 tokens) do. So the preset trains Qwen2.5-7B."""
    cfg = config.parse_args(["--preset", "dapo-qwen2.5-7b", "--model", "Qwen/Qwen2.5-32B"])[0]
    usable, model_cfg = memory.usable_bytes(80 * memory.GB), memory.model_config(cfg.model)
    for lora_rank in (0, 32):
        rank_cfg = dataclasses.replace(cfg, prompts_per_step=64, dtype="bfloat16", lora_rank=lora_rank)
        work = sizes.workload(rank_cfg)
        with memory.planning(model_cfg, work) as planner:
            if work.full:
                assert planner.peak("optimizer") > usable
            else:
                assert planner.peak("pool", 0, planner.floor_blocks(work)) > usable


def test_the_plan_counts_the_attention_path_the_sampler_takes():
    """Qwen3-1.7B, 64 rows at 256 + 4096 tokens: planned on the gather path (the fallback of a GPU whose paged
    kernels fail their self-check), the rollout phase holds each layer's gathered keys and values, which the
    paged paths (flash, flex) read in place: over half a GB more than either."""
    cfg = memory.model_config("Qwen/Qwen3-1.7B")
    own = {}
    for kind in ("flash", "flex", "gather"):
        work = memory.Workload(attention=kind, prompt_len=256, max_new_tokens=4096, prompts_per_step=8, group_size=8)
        with memory.planning(cfg, work) as planner:
            own[kind] = planner.measure("rollout", 8)[1]
    copy = 2 * 64 * (256 + 4096) * cfg.num_kv_heads * cfg.head_dim * 2  # one layer's keys and values, bf16
    assert own["gather"] - max(own["flash"], own["flex"]) > copy / 2, own
    assert abs(own["flash"] - own["flex"]) < copy / 100, own
    with pytest.raises(ValueError, match="Workload.attention"):
        memory.Workload(attention="paged")


def test_the_plan_counts_the_rollouts_dynamic_sampling_holds(atr_planner):
    cfg, planner = memory.model_config("Qwen/Qwen3-1.7B"), atr_planner
    oversampled = memory.Planner(cfg, dataclasses.replace(ATR, sampler_calls=3))
    # the last of 3 calls finds the 2 earlier rollouts held: their [N, P + C] ids and [N, C] ids and log-probs
    grown = oversampled.peak("rollout", 4) - planner.peak("rollout", 4)
    per_rollout = ATR.step_rows * ((ATR.prompt_len + ATR.max_new_tokens) * 9 + ATR.max_new_tokens * (8 + 4 + 1))
    assert grown >= 2 * per_rollout
    assert oversampled.peak("train", 4) == planner.peak("train", 4)  # the step trains on prompts_per_step groups
    # dealing the kept groups out to the ranks after the last call holds 3 rollouts (the last call's, the copy one
    # call sends and what arrived, or what arrived and the step joined from it): more than the sampler's own
    # peak when 256 prompts are sampled one at a time
    many = dataclasses.replace(ATR, prompts_per_step=256)
    rollout = many.step_rows * ((many.prompt_len + many.max_new_tokens) * 9 + many.max_new_tokens * (8 + 4 + 1))
    sampled, dealt = (
        memory.Planner(cfg, dataclasses.replace(many, sampler_calls=calls)).measure("rollout", 1)[1] for calls in (1, 3)
    )
    assert dealt >= 3 * rollout > sampled
    dapo = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b", "--dynamic-sampling", "3"])[0]
    assert sizes.workload(dapo).sampler_calls == 3
    entropy_only = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b", "--top-entropy-quantile", "0.2"])[0]
    assert sizes.workload(entropy_only).with_entropy and not sizes.workload(entropy_only).entropy_grad


def test_a_packed_plan_holds_every_micro_batch_its_budget_admits():
    """fit packs training micro-batches up to the tokens of the rows it chooses, at full length: 64 rows x 128
    tokens, 8,192. Under that budget a pass runs anything from those 64 rows to 248 rows of one new token each;
    the plan measures the two ends, and every shape between them, at each layout, needs no more than the train
    phase it reports, which fits the budget."""
    model_cfg = dataclasses.replace(SMALL, num_layers=2)  # planned at its own depth: a pass counts as the plan's
    work = dataclasses.replace(
        SMALL_WORK, prompts_per_step=64, rollout_prompts=64, micro_batch_rows=256, micro_batch_tokens=256 * (P + C)
    )
    budget = 2 * 10**9
    planner = memory.Planner(model_cfg, work)
    chosen = memory.fit(model_cfg, work, budget, planner=planner)
    assert (chosen.micro_batch_rows, chosen.micro_batch_tokens) == (64, memory.TRAIN_TOKENS)
    assert memory.packed_shapes(chosen, chosen.micro_batch_tokens) == [(64, C), (248, 1)]
    text, fits = memory.report(model_cfg, chosen, budget, planner)
    assert fits and "packed up to 8,192 tokens: 64 rows x 128 tokens" in text, text
    planned = planner.measure("train", chosen.micro_batch_tokens)[1]
    by_rows = memory.Planner(model_cfg, dataclasses.replace(chosen, micro_batch_tokens=0)).measure("train", 64)[1]
    assert planned >= by_rows  # the full-length end is the micro-batch of rows
    for rows in (64, 65, 80, 100, 128, 180, 248):
        completion = memory.TRAIN_TOKENS // rows - P
        for prompts in memory.prompts_per_pass(chosen, rows, "train"):
            with counting.flash_attention_on_meta():
                own = memory.train_phase(planner.runs[0].model, rows, chosen, prompts=prompts, completion=completion)
            assert own <= planned, (rows, completion, prompts, own, planned)
