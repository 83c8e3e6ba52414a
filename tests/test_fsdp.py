"""Full-parameter training (fsdp.py) on CPU processes (gloo), float64: two ranks sharded by FSDP2 take exactly
the step of one unsharded process, one step equals the loss, autograd and AdamW written out by hand, sharded
checkpoints move between world sizes and survive a kill mid-write, the export loads in transformers, and the
per-rank memory plan counts what a real sharded step allocates.

The two-rank runs share one launch, two simulated nodes of one rank each started by torchrun, with
test_distributed's step comparison (two_nodes_launch): the steps, a run that checkpoints, and a counted
micro-batch.
"""

import dataclasses
import functools
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from test_distributed import TIMING_KEYS, metric_lines, patch, tiny_args, two_nodes_launch
from torch.distributed.tensor import DTensor

import config
import eval as evaluation
import lora
import train
from conftest import built_once
from engine import memory, sizes
from engine.graphs import EagerGraph
from infra import distributed, fsdp, rundir, weights
from model import ModelConfig, Transformer

FULL = ("--lora-rank", "0", "--lr", "1e-3")
STEP_CASES = {  # token-mean in one-row micro-batches: the rank with fewer rows of a mini-batch runs idle passes
    "token-mean": ("--aggregation", "token-mean", "--grad-accum", "4"),
    "seq-mean-token-mean": ("--aggregation", "seq-mean-token-mean", "--adv-std", "batch"),
    # micro-batches of 2 rows of one prompt (hidden_shared on the sharded model), idle passes between
    "shared prompts": ("--shuffle", "groups"),
    # rows of 74-79 tokens packed in pairs: a rank's 5 rows of a mini-batch take 3 passes, the other's 3 rows 2 and
    # an idle one (the count agreed by a max over the ranks)
    "packed": ("--aggregation", "token-mean", "--micro-batch-tokens", "160"),
}
STEP_FLAGS = (*FULL, "--updates-per-rollout", "2", "--grad-accum", "2")
RUN_FLAGS = (*FULL, "--checkpoint-every", "1", "--updates-per-rollout", "2")
# a model to count a sharded micro-batch on: big enough that FSDP's buffers matter, small enough to run
COUNTED = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
COUNTED_WORK = memory.Workload(
    dtype=torch.float32, lora_rank=0, prompt_len=16, max_new_tokens=48, micro_batch_rows=3, gradient_checkpointing=True
)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that keeps the whole gradient of every optimizer step (gathered from the shards on every rank)."""

    def __init__(self, params, lr: float):
        super().__init__(params, lr=lr)
        self.grads = []

    def step(self, closure=None):
        self.grads.append(torch.cat([whole(p.grad).flatten() for g in self.param_groups for p in g["params"]]))
        return super().step(closure)


def one_full_step(model_dir, out_dir, flags, world, sharded: bool) -> dict:
    """A fresh float64 model's first full-parameter step: sharded by train.build, or a plain model of one
    process; its metrics line, the gradient of each optimizer step and the weights after them."""
    cfg, _, _ = config.parse_args(tiny_args(model_dir, out_dir, "step", *STEP_FLAGS, *flags))
    if sharded:
        model, tokenizer, _, _ = train.build(cfg)
    else:
        model, tokenizer = (
            weights.from_pretrained(str(model_dir), dtype=torch.float64),
            weights.load_tokenizer(str(model_dir)),
        )
    cfg = sizes.resolve_sizes(cfg, model, tokenizer, [], world)
    optimizer = RecordingAdamW(train.trainable(model), lr=cfg.lr)
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
    record, _ = train.train_step(model, optimizer, tokenizer, problems, cfg, 1, world)
    return {
        "record": {k: v for k, v in record.items() if k not in TIMING_KEYS},
        "grads": optimizer.grads,
        "weights": {name: whole(p).detach().clone() for name, p in model.named_parameters()},
    }


def counted_micro_batch(mesh=None) -> int:
    """Bytes one real sharded training micro-batch of COUNTED allocates on this rank (real CPU tensors)."""
    torch.manual_seed(0)
    model = fsdp.shard(Transformer(COUNTED), torch.float32, mesh)
    model.gradient_checkpointing = True
    memory.optimizer_phase(list(model.parameters()))  # the gradient shards the micro-batch adds into
    return memory.train_phase(
        model, COUNTED_WORK.micro_batch_rows, COUNTED_WORK, memory._ShardedRun._gathered_storages(model)
    )


def ranks_worker(rank, second_port, model_dir, out_dir, result_file):
    patch(setattr)
    shared_passes, hidden_shared = [], train.hidden_shared

    def counted(model, *args):  # (model, prompt_ids, prompt_mask, owner, ...): the pass's rows
        shared_passes.append(len(args[2]))
        return hidden_shared(model, *args)

    plans, micro_batch_plan = [], train.micro_batch_plan

    def recorded_plan(*args):  # per update, each micro-batch's rows (None for an idle one)
        plan = micro_batch_plan(*args)
        plans.append([[None if idle else len(rows) for rows, idle in micro_batches] for micro_batches, _ in plan])
        return plan

    train.hidden_shared, train.micro_batch_plan = counted, recorded_plan
    with distributed.joined(torch.device("cpu"), 60, group=True) as world:
        results = {"steps": {}, "shared_passes": {}, "plans": {}}
        for name, flags in STEP_CASES.items():
            before = len(shared_passes)
            results["steps"][name] = one_full_step(model_dir, out_dir, flags, world, sharded=True)
            results["shared_passes"][name] = shared_passes[before:]
            results["plans"][name] = world.gather(plans.pop())
        results["counted"] = counted_micro_batch()
    if rank == 0:
        torch.save(results, result_file)
    os.environ["MASTER_PORT"] = str(second_port)  # a fresh rendezvous for the run
    train.main(tiny_args(model_dir, out_dir, "split", *RUN_FLAGS, "--steps", "2"))


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory) -> dict:
    """ranks_worker's results in the two-node launch test_distributed's steps share."""
    return two_nodes_launch(tiny_model_dir, tmp_path_factory)["fsdp"]


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory) -> list[dict]:
    """One process's run of 3 steps (a world of one), the metrics the two-rank and resumed runs must log."""

    def build(out_dir: Path) -> list[dict]:
        with pytest.MonkeyPatch.context() as monkeypatch:
            patch(monkeypatch.setattr)
            train.main(tiny_args(tiny_model_dir, out_dir, "straight", *RUN_FLAGS, "--steps", "3"))
        return metric_lines(out_dir / "straight")

    return built_once(tmp_path_factory, "fsdp-straight", build)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("case", STEP_CASES)
def test_two_sharded_ranks_take_the_step_of_one_unsharded_process(
    two_ranks, tiny_model_dir, tmp_path, monkeypatch, case
):
    """Two mini-batches, AdamW, accumulated over micro-batches (of one row for token-mean, two per mini-batch for
    seq-mean-token-mean, two rows of one prompt with --shuffle groups): the gradients the shards were reduced
    to, gathered, and every weight after the two updates are one plain process's. The plain process of the
    shared-prompt case runs every row whole, so the sharded shared pass is checked against the plain path."""
    patch(monkeypatch.setattr)
    if case == "shared prompts":
        policy_states, shared = train.policy_states, []
        monkeypatch.setattr(train, "hidden_shared", lambda *a: shared.append(1))  # never called
        monkeypatch.setattr(train, "policy_states", lambda model, out, rows, G: policy_states(model, out, rows, 1))
    single, ranks = (
        one_full_step(tiny_model_dir, tmp_path, STEP_CASES[case], distributed.SOLO, sharded=False),
        two_ranks["steps"][case],
    )
    assert len(ranks["grads"]) == len(single["grads"]) == 2
    for got, expected in zip(ranks["grads"], single["grads"]):
        assert expected.abs().max() > 1e-3  # a real gradient
        assert relative_error(got, expected) < 1e-12
    assert ranks["weights"].keys() == single["weights"].keys()
    for name, expected in single["weights"].items():
        assert relative_error(ranks["weights"][name], expected) < 1e-12, name
    assert ranks["record"].keys() == single["record"].keys()
    for key, expected in single["record"].items():
        # mismatch/*: a diagnostic over a sample of each rank's rows; micro_batches: how the rows were split
        if not key.startswith("mismatch/") and key != "micro_batches":
            assert ranks["record"][key] == pytest.approx(expected, rel=1e-8, abs=1e-12), key
    assert single["record"]["ratio_max"] > 1 + 1e-6, "the second update saw moved weights"
    if case == "shared prompts":  # rank 0's micro-batches of one prompt's 2 rows, against rows run whole
        assert two_ranks["shared_passes"][case] and set(two_ranks["shared_passes"][case]) == {2} and not shared
    if case == "packed":  # per update the ranks ran as many passes, of 2 rows at most, one rank some idle
        plans = two_ranks["plans"][case]
        assert [len(update) for update in plans[0]] == [len(update) for update in plans[1]] == [3, 3]
        assert None in sum(plans[0] + plans[1], []) and max(r for r in sum(plans[0] + plans[1], []) if r) == 2
        assert ranks["record"]["micro_batches"] == 3 < single["record"]["micro_batches"] == 4
    if case == "token-mean":  # the shuffle of step 1 gives the ranks 5 and 3 rows of each mini-batch
        order = torch.randperm(16, generator=torch.Generator().manual_seed(0 + 1))
        assert [torch.bincount(m // 8, minlength=2).tolist() for m in order.chunk(2)] == [[5, 3], [3, 5]]


def test_a_full_step_is_the_loss_autograd_and_adamw_written_out(tiny_model_dir, tmp_path, monkeypatch):
    """train.py's update of every weight (one process, sharded over a world of one, two micro-batches, clipped)
    against the GRPO loss of the same rollout by hand on a plain model: the ratio is 1 at the first update,
    so the loss is the advantage-weighted log-probability, token-mean."""
    patch(monkeypatch.setattr)
    flags = (
        *FULL,
        "--grad-accum",
        "2",
        "--weight-decay",
        "0.1",
        "--grad-clip",
        "0.05",
        "--rule",
        "grpo",
        "--aggregation",
        "token-mean",
    )
    cfg, _, _ = config.parse_args(tiny_args(tiny_model_dir, tmp_path, "by-hand", *flags))
    with distributed.joined(torch.device("cpu"), 60, group=True) as world:
        model, tokenizer, optimizer, _ = train.build(cfg)
        assert isinstance(optimizer, torch.optim.AdamW) and fsdp.is_sharded(model)
        cfg = sizes.resolve_sizes(cfg, model, tokenizer, [], world)
        problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
        out = train.sample(model, tokenizer, problems, cfg, step=1)
        advantages = train.loss.advantages(train.score(out, problems, cfg)[0], cfg.group_size, cfg.loss)
        metrics, _ = train.policy_update(model, optimizer, out, advantages, cfg, step=1, world=world)
        trained = {name: whole(p).detach().clone() for name, p in model.named_parameters()}

    plain = weights.from_pretrained(str(tiny_model_dir), dtype=torch.float64)
    logp = plain.token_logprobs(out.input_ids, out.pad_mask)[0][:, out.prompt_len :]  # [N, C]
    mask = out.completion_mask
    loss = -(advantages[:, None] * torch.exp(logp - logp.detach()))[mask].sum() / mask.sum()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    assert norm > 0.05, "the clip acts"
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-12)
    torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1).step()
    for name, expected in plain.named_parameters():
        assert relative_error(trained[name], expected.detach()) < 1e-12, name


def test_a_full_run_samples_each_step_with_its_updated_weights_through_the_runs_pool(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The run's pool is made once and given a resident copy of the whole weights; each rollout copies the
    updated weights into it in place, so the graphs (fixed shapes, replayed by EagerGraph) survive the steps: over 3
    steps each (rows, span) is captured once, and the third step's samples and old log-probs are those of a
    graph-free sampler over the updated model, not the starting one's."""
    patch(monkeypatch.setattr)
    monkeypatch.setattr(train.rollout, "generate", functools.partial(train.rollout.generate, fixed_shapes=True))
    cfg, _, _ = config.parse_args(tiny_args(tiny_model_dir, tmp_path, "pool", *FULL, "--cuda-graphs", "on"))
    captures = []
    generate = train.rollout.generate

    def counted(*args, **kwargs):
        out = generate(*args, **kwargs)
        captures.append(out.stats.captures)
        return out

    monkeypatch.setattr(train.rollout, "generate", counted)
    with distributed.joined(torch.device("cpu"), 60, group=True) as world:
        model, tokenizer, optimizer, reference = train.build(cfg)
        train_set = train.load_problems(cfg.dataset)
        cfg = sizes.resolve_sizes(cfg, model, tokenizer, train_set, world)
        pool = sizes.sampler_pool(cfg, model, tokenizer, train_set, {})
        assert pool.model is None and pool.kv.k.dtype == torch.float64
        pool.resident = fsdp.resident_copy(model)
        pool.graph_class = pool.graphs.graph_class = EagerGraph
        for step in (1, 2):
            problems = train.batch_of(train_set, (step - 1) * cfg.prompts_per_step, cfg.prompts_per_step, cfg.seed)
            train.train_step(model, optimizer, tokenizer, problems, cfg, step, world, reference, pool)
        assert pool.model is pool.resident and pool.graphs.captured, "the graphs of steps 1 and 2 are kept"
        third = train.batch_of(train_set, 2 * cfg.prompts_per_step, cfg.prompts_per_step, cfg.seed)
        out = train.sample(model, tokenizer, third, cfg, 3, pool=pool)
        fresh = train.sample(model, tokenizer, third, dataclasses.replace(cfg, cuda_graphs="off"), 3)
        with fsdp.whole(model) as updated:
            updated_logp = updated.token_logprobs(out.input_ids, out.pad_mask)[0][:, out.prompt_len :]
    assert sum(captures[:3]) == len(pool.graphs.captured) > 0, captures  # one capture per (rows, span)
    mask = out.completion_mask
    assert out.completions == fresh.completions
    torch.testing.assert_close(out.old_logp[mask], fresh.old_logp[mask], rtol=0, atol=1e-12)
    torch.testing.assert_close(out.old_logp[mask], updated_logp[mask].float(), rtol=0, atol=1e-6)  # kept in fp32
    start = weights.from_pretrained(str(tiny_model_dir), dtype=torch.float64)
    start_logp = start.token_logprobs(out.input_ids, out.pad_mask)[0][:, out.prompt_len :]
    assert (out.old_logp - start_logp)[mask].abs().max() > 1e-3, "steps 1 and 2 moved the weights the rollout read"


def test_rank_0_trains_every_weight_and_a_rank_only_its_adapters(tiny_model_dir, tmp_path, monkeypatch):
    patch(monkeypatch.setattr)
    for rank in (0, 4):
        cfg, _, _ = config.parse_args(
            tiny_args(tiny_model_dir, tmp_path, f"rank{rank}", "--lora-rank", str(rank), "--lr", "1e-3")
        )
        with distributed.joined(torch.device("cpu"), 60, group=not rank) as world:
            model, tokenizer, optimizer, _ = train.build(cfg)
            cfg = sizes.resolve_sizes(cfg, model, tokenizer, [], world)
            before = {name: whole(p).detach().clone() for name, p in model.named_parameters()}
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
            train.train_step(model, optimizer, tokenizer, problems, cfg, 1, world)
            moved = {name: not torch.equal(whole(p).detach(), before[name]) for name, p in model.named_parameters()}
            if rank == 0:
                assert stepped == {id(p) for p in model.parameters()}
                assert all(moved.values()), [name for name, m in moved.items() if not m]
            else:
                assert stepped == {id(p) for p in lora.parameters(model)}
                assert not any(m for name, m in moved.items() if ".lora_" not in name)
                assert any(m for name, m in moved.items() if ".lora_B" in name)


def test_a_sharded_checkpoint_of_two_ranks_resumes_on_one(two_ranks, straight, monkeypatch):
    """Two ranks write each checkpoint's shards (one file each); one process reads them all and continues
    with the metrics one process alone logs from the start."""
    split = two_ranks["split"]
    shards = split / (split / "latest").read_text() / rundir.SHARDS
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list(split.glob(".*.tmp")), "no half-written checkpoint left behind"
    patch(monkeypatch.setattr)
    train.main(["--resume", str(split), "--steps", "3"])
    resumed = metric_lines(split)
    assert [line["step"] for line in resumed] == [1, 2, 3]
    for got, expected in zip(resumed, straight):
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            # mismatch/*: a diagnostic over a sample of each rank's rows; micro_batches: how the rows were split
            if not key.startswith("mismatch/") and key != "micro_batches":
                assert got[key] == pytest.approx(value, rel=1e-8, abs=1e-12), (got["step"], key)


def test_a_checkpoint_killed_mid_write_is_ignored(tiny_model_dir, straight, tmp_path, monkeypatch):
    """The kill comes after every shard of step 2 is on disk, while trainer.pt is half written: `latest` still
    names step 1, which the run resumes from, and it logs what an uninterrupted run logs."""
    patch(monkeypatch.setattr)
    save = torch.save

    def killed_at_step_2(value, file, *args, **kwargs):
        if ".checkpoint-000002.tmp" in str(getattr(file, "name", file)):  # rundir writes through an open file
            file.write(b"trunc")
            raise KeyboardInterrupt  # as the process dies: nothing after this line runs
        save(value, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", killed_at_step_2)
    with pytest.raises(SystemExit) as exit_info:
        train.main(tiny_args(tiny_model_dir, tmp_path, "killed", *RUN_FLAGS, "--steps", "3"))
    assert exit_info.value.code == 130
    run_dir = tmp_path / "killed"
    assert (run_dir / "latest").read_text() == "checkpoint-000001"
    assert (run_dir / ".checkpoint-000002.tmp" / rundir.SHARDS / ".metadata").is_file()
    monkeypatch.setattr(torch, "save", save)
    train.main(["--resume", str(run_dir), "--steps", "3"])
    resumed = metric_lines(run_dir)
    assert [line["step"] for line in resumed] == [1, 2, 3]
    for got, expected in zip(resumed, straight):
        for key, value in expected.items():
            if not key.startswith(
                "mismatch/"
            ):  # mismatch/*: a diagnostic over a sample of each rank's rows, not part of the update
                assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-14), (got["step"], key)


def test_the_export_of_a_full_run_loads_in_transformers_with_the_trained_logits(tiny_model_dir, tmp_path, monkeypatch):
    """float32, as a CPU run trains: the export holds the weights of the last checkpoint."""
    monkeypatch.setattr(train.reward, "reward", lambda texts, references, **_: [float(len(t) % 2) for t in texts])
    args = tiny_args(
        tiny_model_dir,
        tmp_path,
        "full",
        "--lora-rank",
        "0",
        "--lr",
        "1e-2",
        "--steps",
        "1",
        "--export",
        str(tmp_path / "exported"),
    )
    train.main(args)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["dtype"] == "float32"
    ids = torch.randint(0, exported.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    cfg, _, _ = config.parse_args(args)
    with distributed.joined(torch.device("cpu"), 60, group=True):
        model, _, optimizer, _ = train.build(cfg)
        rundir.load_checkpoint(tmp_path / "full", model, optimizer)
        with torch.no_grad(), fsdp.whole(model) as trained:
            ours = trained(ids)
    with torch.no_grad():
        theirs, initial = exported(ids).logits, weights.from_pretrained(str(tiny_model_dir))(ids)
    assert (ours - initial).abs().max() > 1e-3, "one step at lr 1e-2 moved the logits"
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (tmp_path / "full" / "best" / "model.safetensors").is_file()  # the best step's weights, the same way
    run_args = evaluation.parse_args(
        ["--run", str(tmp_path / "full"), "--checkpoint", "best"]
    )  # eval.py evaluates them
    assert run_args.model == str(tmp_path / "full" / "best") and run_args.adapter is None
    train.main(["--resume", str(tmp_path / "full"), "--steps", "0", "--export", str(tmp_path / "again")])
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs), "an export-only resume writes the same weights"


def planned_micro_batch(world_size: int) -> int:
    """The same micro-batch as memory.py's sharded run counts it: fully_shard over a fake world, fake tensors.
    CPU attention rather than the plan's FlashAttention stand-in, which test_memory checks on its own."""
    work = dataclasses.replace(COUNTED_WORK, world_size=world_size)
    with memory.fake_world(world_size) as mesh:
        run = memory._ShardedRun(COUNTED, work, mesh)
        with run.mode:
            return memory.train_phase(run.model, work.micro_batch_rows, work, run.resizable)


def test_the_plan_of_a_sharded_micro_batch_is_what_a_real_one_allocates(two_ranks):
    """One process (a world of one) counted here, rank 0 of two counted in the two-rank launch."""
    with distributed.joined(torch.device("cpu"), 60, group=True):
        real_one = counted_micro_batch()
        planned_one = planned_micro_batch(1)
    assert planned_one == real_one
    assert planned_micro_batch(2) == two_ranks["counted"]


def test_full_step_bench_dry_run(tmp_path):
    """bench/full_step.py end to end on a tiny Qwen3 on the CPU (in this process: the imports are paid), so the
    script is not what breaks on a GPU."""
    path = Path(train.__file__).parent / "bench" / "full_step.py"
    spec = importlib.util.spec_from_file_location("bench_full_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "full_step.json").read_text())
    assert report["tokens_per_s"] > 0 and len(report["steps"]) == 4 and report["peak_allocated_bytes"] is None
    assert report["planned_bytes"]["train"] > report["planned_bytes"]["optimizer"] > 0
