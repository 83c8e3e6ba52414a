"""Data parallel training on CPU processes (gloo): two ranks with half the batch each take exactly the step
of one process with the whole batch, a run moves between world sizes, and mistakes fail clearly.

Each test starts its ranks as fresh processes that meet through a local TCP port, as under torchrun. The step
comparison starts them with torchrun itself, as two nodes of one rank each (run_nodes), in one launch with
test_fsdp's sharded runs (two_nodes_launch); the others fork them from a server that imported the modules
(run_ranks), which costs two agents and the imports less.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import config
import loss
import train
from conftest import RecordingSGD, assert_equal_to, built_once, start_fork_server
from engine import sizes
from infra import distributed

TIMING_KEYS = {"step_seconds", "rollout_tokens_per_s", "reward_seconds", "train_tokens_per_s"}
RANK_ENTRY = Path(__file__).with_name("rank_entry.py")


def run_ranks(worker, size: int, *args) -> list[int]:
    """worker(rank, *args) in `size` fresh processes; their exit codes. Each is joined on its own, so one
    rank failing does not kill the others before they report. The ranks are forked from multiprocessing's
    fork server, a process that imported torch, the trainer and the workers' modules once
    (conftest.start_fork_server), so a rank does not import them again (the test's own process holds threads
    and must not fork).

    The ranks meet at a TCP store this process holds, as torchrun's agent holds it: its port is bound here
    before any rank starts and stays open until every rank has ended. (Picking a free port for rank 0 to
    bind later leaves the port to whoever takes it first on a busy machine, and a store hosted by rank 0
    goes away when rank 0 exits, while rank 1 may still be shutting down.)"""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    start_fork_server()
    context = mp.start_processes(
        spawned, args=(size, store.port, worker, args), nprocs=size, join=False, start_method="forkserver"
    )
    for process in context.processes:
        process.join(600)
    for process in context.processes:
        if process.is_alive():  # hung: the test fails with exit code None, and leaves nothing running
            process.kill()
    del store  # only now: the ranks are gone
    return [process.exitcode for process in context.processes]


def spawned(rank: int, size: int, port: int, worker, args: tuple) -> None:
    """One rank of run_ranks: the environment torchrun gives each process, the store held by the launcher."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    torch.set_num_threads(1)
    worker(rank, *args)


def run_nodes(worker, log_dir: Path, *args, timeout: float = 600) -> None:
    """worker(rank, *args) as the one rank of each of two nodes: two torchrun agents started together, as the
    same command starts on each node of a cluster, meeting at a c10d rendezvous on this machine, each
    running rank_entry.py. Fails with both agents' output (kept in log_dir) unless both end with 0 and each
    rank was the one rank of its node.

    The rendezvous store is this process's: bound here at a port of the system's choosing before the agents
    start, open until both have ended, and both agents are told not to host it (is_host=false). Left to
    guess, each agent of an endpoint on this machine tries to host the store itself, at a port that would
    have to be picked here and left free for anyone to take first. The agent that becomes node 0 then opens
    the ranks' own store at a port of its choosing, as on a cluster, and hands it to the ranks as
    MASTER_ADDR (--local-addr: loopback rather than this machine's FQDN) and MASTER_PORT. c10d numbers the
    nodes in the order of the agents' addresses and process ids, so no --node-rank is given (c10d ignores it)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", f"nodes-{store.port}"),
        *("--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1"),
        *(str(RANK_ENTRY), f"{worker.__module__}.{worker.__name__}", *map(str, args)),
    ]
    logs = [log_dir / f"agent-{node}.log" for node in range(2)]
    env = {**os.environ, "NODE_LOG_DIR": str(log_dir)}  # where rank_entry.py writes each rank's placement
    agents = []
    try:
        for log in logs:
            with open(log, "wb") as out:
                agents.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
        wait_for(agents, timeout)
    finally:
        stopped = [agent.poll() is None for agent in agents]  # still running: hung, or its peer failed
        for agent in agents:
            stop(agent)
        del store  # only now: the agents are gone
    codes = [agent.returncode for agent in agents]
    outputs = "\n".join(
        f"--- agent {node} (exit {code}{', stopped while still running' if halted else ''}):\n{log.read_text()}"
        for node, (code, halted, log) in enumerate(zip(codes, stopped, logs))
    )
    assert codes == [0, 0], f"the two torchrun agents ended with {codes}\n{outputs}"
    placements = [json.loads((log_dir / f"node-rank-{rank}.json").read_text()) for rank in range(2)]
    assert placements == [
        dict(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_RANK=rank, GROUP_WORLD_SIZE=2)
        for rank in range(2)
    ], f"{placements}\n{outputs}"


def wait_for(agents: list[subprocess.Popen], timeout: float) -> None:
    """Until every agent has ended, or `timeout` seconds. Once one fails, the others get 30 s to fail in turn
    (their rank meets the dead one at its next collective) and report it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(agent.poll() is None for agent in agents):
        if any(agent.returncode not in (None, 0) for agent in agents):
            deadline = min(deadline, time.monotonic() + 30)
        time.sleep(0.2)


def stop(agent: subprocess.Popen) -> None:
    """End an agent still running: SIGTERM first, on which torchrun stops its worker (a session of its own,
    which killing the agent alone would leave running), then SIGKILL."""
    if agent.poll() is not None:
        return
    agent.send_signal(signal.SIGTERM)
    try:
        agent.wait(60)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


def patch(setattr) -> None:
    """Float64 everywhere, rewards by length parity (a random model never solves a problem, and every
    advantage would be 0) and a quarter of the vocabulary ending a row, so lengths and padding vary."""
    setattr(config, "resolve_device", lambda cfg: (torch.device("cpu"), torch.float64))
    setattr(train.reward, "reward", lambda texts, references, **_: [float(len(t) % 2) for t in texts])
    setattr(train, "stop_ids", lambda config, tok: list(range(0, len(tok), 4)))


def tiny_args(model_dir, out_dir, name: str, *extra: str) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--out-dir",
        str(out_dir),
        "--run-name",
        name,
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--lora-rank",
        "4",
        "--eval-problems",
        "3",
        "--eval-k",
        "2",
        "--eval-batch",
        "1",
        *extra,
    ]


STEP_CASES = {
    "token-mean": ("--aggregation", "token-mean"),
    "seq-mean-token-mean": ("--aggregation", "seq-mean-token-mean", "--adv-std", "batch"),
    "groups": ("--aggregation", "seq-mean-token-mean", "--shuffle", "groups"),
}
STEP_FLAGS = ("--updates-per-rollout", "2", "--grad-accum", "2")


def one_step(model_dir, out_dir, flags, world) -> dict:
    """A fresh float64 model's first step: its metrics line and the gradient of each of its optimizer steps."""
    cfg, _, _ = config.parse_args(tiny_args(model_dir, out_dir, "step", *STEP_FLAGS, *flags))
    model, tokenizer, _, _ = train.build(cfg)
    model.to(torch.float64)  # the adapters too
    cfg = sizes.resolve_sizes(cfg, model, tokenizer, [], world)
    optimizer = RecordingSGD(train.lora.parameters(model))
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
    record, _ = train.train_step(model, optimizer, tokenizer, problems, cfg, 1, world)
    return {"record": {k: v for k, v in record.items() if k not in TIMING_KEYS}, "grads": optimizer.grads}


def whole_rows(setattr) -> None:
    """Every row runs whole, each with its own copy of its prompt: the reference of the shared layout."""
    policy_states = train.policy_states
    setattr(train, "policy_states", lambda model, out, rows, group_size: policy_states(model, out, rows, 1))


def step_worker(rank, model_dir, out_dir, result_file):
    with pytest.MonkeyPatch.context() as monkeypatch:  # undone before the launch's next worker
        patch(monkeypatch.setattr)
        cfg, _, _ = config.parse_args(tiny_args(model_dir, out_dir, "step"))
        with distributed.joined(config.resolve_device(cfg)[0], cfg.dist_timeout) as world:
            results = {name: one_step(model_dir, out_dir, flags, world) for name, flags in STEP_CASES.items()}
            whole_rows(monkeypatch.setattr)
            results |= {
                f"{name}, whole rows": one_step(model_dir, out_dir, flags, world) for name, flags in STEP_CASES.items()
            }
    if rank == 0:
        torch.save(results, result_file)


def nodes_worker(rank, fsdp_port, run_port, model_dir, out_dir):
    """The two-node launch's rank: this module's steps (at the agent's store), then test_fsdp's sharded runs (at
    fresh stores of the test's: a process group is made once per store)."""
    import test_fsdp  # here, not above: test_fsdp imports this module

    step_worker(rank, model_dir, out_dir, Path(out_dir, "steps.pt"))
    os.environ["MASTER_PORT"] = str(fsdp_port)
    fsdp_dir = Path(out_dir, "fsdp")
    fsdp_dir.mkdir(exist_ok=True)
    test_fsdp.ranks_worker(rank, run_port, model_dir, fsdp_dir, fsdp_dir / "results.pt")


def two_nodes_launch(model_dir: Path, tmp_path_factory) -> dict:
    """What the ranks of one torchrun launch of two simulated nodes of one rank each computed, for this module
    (steps) and test_fsdp (fsdp: sharded steps, a counted micro-batch, the folder of a run that checkpoints):
    the suite pays two agents and two rank processes once."""

    def build(out_dir: Path) -> dict:
        stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
        run_nodes(nodes_worker, out_dir, *(store.port for store in stores), model_dir, out_dir)
        del stores  # only now: the ranks are gone
        fsdp_dir = out_dir / "fsdp"
        fsdp = {**torch.load(fsdp_dir / "results.pt"), "split": fsdp_dir / "split"}
        return {"steps": torch.load(out_dir / "steps.pt"), "fsdp": fsdp}

    return built_once(tmp_path_factory, "two-nodes", build)


@pytest.fixture(scope="module")
def two_rank_steps(tiny_model_dir, tmp_path_factory) -> dict:
    """The steps of two simulated nodes of one rank each, started by torchrun."""
    return two_nodes_launch(tiny_model_dir, tmp_path_factory)["steps"]


@pytest.mark.parametrize("case", STEP_CASES)
def test_two_ranks_take_the_step_of_one_process(two_rank_steps, tiny_model_dir, tmp_path, monkeypatch, case):
    """Two mini-batches of two micro-batches each: the global shuffle splits each mini-batch unevenly over
    the ranks, and the second update starts from moved weights."""
    patch(monkeypatch.setattr)
    single, ranks = one_step(tiny_model_dir, tmp_path, STEP_CASES[case], distributed.SOLO), two_rank_steps[case]
    assert len(ranks["grads"]) == len(single["grads"]) == 2
    for got, expected in zip(ranks["grads"], single["grads"]):
        assert expected.abs().max() > 1e-3  # a real gradient
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
    assert ranks["record"].keys() == single["record"].keys()
    for key, expected in single["record"].items():  # mismatch/* too: float64 recomputes every row's old log-probs
        if key != "micro_batches":  # how the rows were split: each rank's passes against one process's
            assert ranks["record"][key] == pytest.approx(expected, rel=1e-5, abs=1e-8), key
    assert single["record"]["mismatch/rows"] == 16, "the mismatch is over both ranks' rows"
    assert single["record"]["ratio_max"] > 1 + 1e-6, "the second update saw moved weights"


@pytest.mark.parametrize("case", STEP_CASES)
def test_two_ranks_sharing_prompts_take_the_step_of_whole_rows(two_rank_steps, case):
    """Each rank runs each prompt once per micro-batch: the gradients and metrics of rows run whole, to 1e-12."""
    shared, whole = two_rank_steps[case], two_rank_steps[f"{case}, whole rows"]
    for got, expected in zip(shared["grads"], whole["grads"], strict=True):
        assert_equal_to(got, expected)
    assert shared["record"].keys() == whole["record"].keys()
    for key, expected in whole["record"].items():
        assert shared["record"][key] == pytest.approx(expected, rel=1e-12, abs=1e-15), key


# ----------------------------------------------------------------------------- dynamic sampling over two ranks

# Of the 3 calls' 12 prompts (4 a call, 2 a rank), the ones whose rows all score 0; every other group's rows
# score 0, 1, 0, 1. The step keeps the 4 groups whose rewards differ, in the order sampled, else equal ones of
# the first calls; rank r trains the kept groups 2r, 2r + 1.
DYNAMIC_CASES = {
    # call 0 differs on rank 0's groups 0 and 1, call 1 on rank 0's groups 4 and 5: it stops after 2 calls, and
    # rank 0 sends 4 and 5 to rank 1
    "two calls, rank 0 sends": (2, 3, 6, 7),
    # only groups 3 and 6 (both rank 1's) differ: 3 calls, then the equal groups 0 and 1 (rank 0's) fill the
    # step, so each rank trains the other's groups
    "three calls, either rank sends": (0, 1, 2, 4, 5, 7, 8, 9, 10, 11),
    # only group 2 (rank 1's) differs: the step is 2, then call 0's equal 0, 1, 3; rank 0 trains 2 and 0, which
    # reach it in rank order (0 from itself, 2 from rank 1), the other way round from the step's
    "three calls, out of rank order": (0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11),
}


def rig_rewards(setattr, equal: list[str]) -> None:
    """Rows of the problems in `equal` score 0, the others' by row parity (G even: 0, 1, 0, 1 in each group)."""
    setattr(
        train.reward,
        "reward",
        lambda texts, references, problems, **_: [0.0 if q in equal else float(i % 2) for i, q in enumerate(problems)],
    )


def dynamic_step(model_dir, out_dir, equal_at, world, setattr) -> dict:
    """A fresh float64 model's first step under --dynamic-sampling 3 with rigged rewards: every rank's kept rows in
    rank order (completion, reward, old log-probs), the step's metrics line and each optimizer step's gradient."""
    cfg, _, _ = config.parse_args(tiny_args(model_dir, out_dir, "dynamic", *STEP_FLAGS, "--dynamic-sampling", "3"))
    model, tokenizer, _, _ = train.build(cfg)
    model.to(torch.float64)
    cfg = sizes.resolve_sizes(cfg, model, tokenizer, [], world)
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, 3 * cfg.prompts_per_step, cfg.seed)
    rig_rewards(setattr, [problems[i]["problem"] for i in equal_at])
    out, scores, _ = train.dynamic_sample(model, tokenizer, problems, cfg, 1, False, train.Stopwatch(), world)
    rows = list(
        zip(
            out.completions, scores.reward.tolist(), (row[mask] for row, mask in zip(out.old_logp, out.completion_mask))
        )
    )
    optimizer = RecordingSGD(train.lora.parameters(model))
    record, _ = train.train_step(model, optimizer, tokenizer, problems, cfg, 1, world)
    return {
        "rows": sum(world.gather(rows), []),
        "record": {k: v for k, v in record.items() if k not in TIMING_KEYS},
        "grads": optimizer.grads,
    }


def dynamic_worker(rank, model_dir, out_dir, result_file):
    patch(setattr)
    cfg, _, _ = config.parse_args(tiny_args(model_dir, out_dir, "dynamic"))
    with distributed.joined(config.resolve_device(cfg)[0], cfg.dist_timeout) as world:
        results = {name: dynamic_step(model_dir, out_dir, at, world, setattr) for name, at in DYNAMIC_CASES.items()}
    if rank == 0:
        torch.save(results, result_file)


@pytest.fixture(scope="module")
def two_rank_dynamic_steps(tiny_model_dir, tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("two-rank-dynamic")
    assert run_ranks(dynamic_worker, 2, tiny_model_dir, out_dir, out_dir / "steps.pt") == [0, 0]
    return torch.load(out_dir / "steps.pt")


@pytest.mark.parametrize("case", DYNAMIC_CASES)
def test_dynamic_sampling_on_two_ranks_keeps_and_trains_the_groups_of_one_process(
    two_rank_dynamic_steps, tiny_model_dir, tmp_path, monkeypatch, case
):
    """The same sampler calls and kept groups, in the same order (each rank's share, gathered), and the same
    update: two mini-batches of two micro-batches, as the plain step's test."""
    patch(monkeypatch.setattr)
    single = dynamic_step(tiny_model_dir, tmp_path, DYNAMIC_CASES[case], distributed.SOLO, monkeypatch.setattr)
    ranks = two_rank_dynamic_steps[case]
    assert [(text, reward) for text, reward, _ in ranks["rows"]] == [
        (text, reward) for text, reward, _ in single["rows"]
    ]
    for (_, _, got), (_, _, expected) in zip(ranks["rows"], single["rows"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)  # each token's old log-prob
    expected_calls = 2 if case.startswith("two calls") else 3
    assert (
        single["record"]["dynamic/calls"] == expected_calls
        and single["record"]["dynamic/groups_sampled"] == 4 * expected_calls
    )
    assert len(ranks["grads"]) == len(single["grads"]) == 2
    for got, expected in zip(ranks["grads"], single["grads"]):
        assert expected.abs().max() > 1e-3  # a real gradient
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-9)
    assert ranks["record"].keys() == single["record"].keys()
    for key, expected in single["record"].items():
        if key != "micro_batches":  # how the rows were split: each rank's passes against one process's
            assert ranks["record"][key] == pytest.approx(expected, rel=1e-5, abs=1e-8), key


# ----------------------------------------------------------------------------- the mismatch over two ranks


def mismatch_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's sampler and trainer log-probs [rows, 6] and mask: 3 rows on rank 0, 5 on rank 1, some tokens
    masked, some ratios outside [0.5, 2]."""
    generator = torch.Generator().manual_seed(rank)
    rows = 3 + 2 * rank
    sampler = -3 * torch.rand(rows, 6, generator=generator, dtype=torch.float64)
    trainer = sampler + (0.3 + 0.5 * rank) * torch.randn(rows, 6, generator=generator, dtype=torch.float64)
    mask = torch.rand(rows, 6, generator=generator) < 0.7
    mask[:, 0] = True
    return sampler, trainer, mask


def mismatch_stats_worker(rank, out_dir):
    with distributed.joined(torch.device("cpu"), 60) as world:
        stats = train.ranks_mismatch(*mismatch_inputs(rank), world)
    torch.save(stats, Path(out_dir, f"rank{rank}.pt"))


def test_the_mismatch_of_two_ranks_is_that_of_their_tokens_together(tmp_path):
    """Each rank's figures, reduced across the ranks, are loss.mismatch over both ranks' tokens at once (their
    token counts differ, so a plain mean of the two would not be), and the rows add up."""
    assert run_ranks(mismatch_stats_worker, 2, tmp_path) == [0, 0]
    parts = [mismatch_inputs(rank) for rank in range(2)]
    together = loss.mismatch(*(torch.cat(tensors) for tensors in zip(*parts)))
    own = [loss.mismatch(*part) for part in parts]
    assert own[0]["mismatch/abs_mean"] != pytest.approx(own[1]["mismatch/abs_mean"], rel=0.1)
    assert together["mismatch/out_frac"] > 0
    for rank in range(2):
        reduced = torch.load(tmp_path / f"rank{rank}.pt")
        assert reduced == pytest.approx(together | {"mismatch/rows": 8}, rel=1e-12)
        assert reduced["mismatch/abs_max"] == max(stats["mismatch/abs_max"] for stats in own)


def run_worker(rank, argv):
    patch(setattr)
    train.main(argv)


def metric_lines(run_dir: Path) -> list[dict]:
    """The steps' lines, without timings (a resume's event line is not a step)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines if "event" not in line]


def test_a_run_started_on_two_ranks_resumes_on_one(tiny_model_dir, tmp_path, monkeypatch):
    """Two ranks write one run (rank 0's files, evaluations split and gathered); one process continues it
    and ends where one process alone from the start ends."""
    steps = ("--checkpoint-every", "1", "--eval-every", "1", "--updates-per-rollout", "2")
    assert run_ranks(run_worker, 2, tiny_args(tiny_model_dir, tmp_path, "split", *steps, "--steps", "2")) == [0, 0]
    assert not list((tmp_path / "split").glob(".*.tmp")), "no half-written file left behind"
    patch(monkeypatch.setattr)
    train.main(tiny_args(tiny_model_dir, tmp_path, "straight", *steps, "--steps", "3"))
    train.main(["--resume", str(tmp_path / "split"), "--steps", "3"])
    split, straight = metric_lines(tmp_path / "split"), metric_lines(tmp_path / "straight")
    assert [line["step"] for line in split] == [1, 2, 3]
    assert split[0]["eval"] == pytest.approx(straight[0]["eval"], rel=1e-5)  # split over the two ranks
    for got, expected in zip(split, straight):
        for evaluated in ("eval", "validation"):  # the two-rank run ended at step 2: no evaluation there, only after
            expected.pop(evaluated, None)
        assert got.keys() - {"eval", "validation"} == expected.keys()
        for key, value in expected.items():
            # mismatch/*: a diagnostic over a sample of each rank's rows; micro_batches: how the rows were split
            if not key.startswith("mismatch/") and key != "micro_batches":
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-8), (got["step"], key)
    split, straight = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("split", "straight"))
    for when in ("before", "after"):
        assert split[when] == pytest.approx(straight[when], rel=1e-5), when


def test_a_batch_that_does_not_split_into_whole_prompts_fails_before_loading(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WORLD_SIZE", "2")  # no peer is started: the check comes before joining
    with pytest.raises(SystemExit) as exit_info:
        train.main(tiny_args(tiny_model_dir, tmp_path, "odd", "--prompts-per-step", "3"))
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and "--prompts-per-step 3 does not split over 2 processes" in message


def mismatch_worker(rank, model_dir, out_dir):
    cfg, _, _ = config.parse_args(tiny_args(model_dir, out_dir, "mismatch", "--lr", str(0.001 * (rank + 1))))
    with distributed.joined(config.resolve_device(cfg)[0], cfg.dist_timeout) as world:
        try:
            distributed.check_same_settings(world, config.flat_config(cfg))
        except ValueError as error:
            Path(out_dir, f"rank{rank}.txt").write_text(str(error))


def test_ranks_with_different_settings_name_the_difference(tiny_model_dir, tmp_path):
    assert run_ranks(mismatch_worker, 2, tiny_model_dir, tmp_path) == [0, 0]
    assert (
        (tmp_path / "rank0.txt").read_text().startswith("rank 1 runs other settings than rank 0: lr=0.002 (here 0.001)")
    )
    assert (tmp_path / "rank1.txt").read_text().startswith("rank 0 runs other settings than rank 1: lr=0.001")


def dying_worker(rank, model_dir, out_dir):
    cfg, _, _ = config.parse_args(tiny_args(model_dir, out_dir, "dies", "--dist-timeout", "10"))
    with distributed.joined(config.resolve_device(cfg)[0], cfg.dist_timeout) as world:
        world.barrier("starting")
        if rank == 1:
            os._exit(1)  # dies without a word, as a process killed for memory does
        try:
            world.sum(torch.ones(3))
        except RuntimeError as error:
            Path(out_dir, "rank0.txt").write_text(str(error))


def test_a_rank_that_dies_is_an_error_naming_the_cause(tiny_model_dir, tmp_path):
    assert run_ranks(dying_worker, 2, tiny_model_dir, tmp_path)[1] == 1
    assert (
        (tmp_path / "rank0.txt")
        .read_text()
        .startswith("rank 0 of 2: a sum across processes failed; another process died or hangs")
    )


def test_nccl_collectives_do_not_block_the_host(monkeypatch):
    """On CUDA the process group is made without TORCH_NCCL_BLOCKING_WAIT (each collective would block the host
    and FSDP2's prefetch would not overlap) and with NCCL's watchdog tearing down a collective past the timeout.
    The CUDA calls are replaced, so this runs on the CPU: it checks the environment the group is made in."""
    seen = {}
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, env=dict(os.environ))
    )
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    with distributed.joined(torch.device("cuda"), 60, group=True):
        pass
    assert seen["backend"] == "nccl"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in seen["env"]
    assert seen["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
