"""counterfactual.py: the rule is the only difference between arms, the same arm twice is the same, and the
table runs end to end on a tiny model."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch

import config
import loss
import train
from research import counterfactual


@pytest.fixture(autouse=True)
def varied_rewards(monkeypatch):
    """A random model never solves a problem; rewarding completions by the parity of their length gives
    the updates real, deterministic signal (as test_train.py does)."""
    monkeypatch.setattr(train.reward, "reward", lambda texts, references, **_: [float(len(t) % 2) for t in texts])


def study_flags(model_dir) -> list[str]:
    """A tiny model's flags that counterfactual.py and study.py take themselves."""
    return [
        "--model",
        str(model_dir),
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--updates-per-rollout",
        "4",
        "--lr",
        "0.05",
        "--dataset",
        "two_digit",
    ]


def tiny_flags(model_dir) -> list[str]:
    return study_flags(model_dir) + ["--lora-rank", "4"]


@pytest.fixture
def setup(tiny_model_dir, monkeypatch):
    """A model, its optimizer after one update (so Adam has moments to copy), the saved state, and prompts."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    shared = tiny_flags(tiny_model_dir)
    arms = counterfactual.arm_configs(shared, ["grpo", "atr", "kl-atomic"], {})
    cfg = arms["grpo"]
    model, tokenizer, optimizer, _ = train.build(cfg)  # LoRA: the reference is the frozen base
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
    train.train_step(model, optimizer, tokenizer, problems, cfg, step=1)
    return shared, arms, model, tokenizer, optimizer, counterfactual.State.of(model, optimizer), problems


def update_records(model, optimizer, tokenizer, state, cfg, out, advantages):
    """One arm's update of the rollout from the saved state: its per-token records and the weights after."""
    state.restore(model, optimizer)
    _, records = train.policy_update(model, optimizer, out, advantages, cfg, 5, keep_records=True)
    return records, {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def test_the_same_arm_twice_gives_identical_results(setup):
    shared, arms, model, tokenizer, optimizer, state, problems = setup
    twice = {"grpo": arms["grpo"], "grpo again": arms["grpo"], "atr": arms["atr"]}
    line = counterfactual.counterfactual_rollout(model, optimizer, tokenizer, state, twice, problems, 5, 2)
    assert line["arms"]["grpo"] == line["arms"]["grpo again"]
    again = counterfactual.counterfactual_rollout(model, optimizer, tokenizer, state, twice, problems, 5, 2)
    assert json.dumps(again, sort_keys=True) == json.dumps(line, sort_keys=True)  # nan-safe equality
    assert line["arms"]["grpo"]["clip"] > 0, "the setup must clip, or the comparisons below say nothing"
    for name, p in model.named_parameters():  # the state is restored after the rollout
        if p.requires_grad:
            assert torch.equal(p, state.weights[name])


def test_two_rules_differ_only_where_their_regions_differ(setup):
    shared, arms, model, tokenizer, optimizer, state, problems = setup
    state.restore(model, optimizer)
    cfg = arms["grpo"]
    out = train.sample(model, tokenizer, problems, cfg, 5)
    rewards, *_ = train.score(out, problems, cfg)
    advantages = loss.advantages(rewards, cfg.group_size, cfg.loss)
    # the same region written another way: the same update to the last bit
    same_cfg = dataclasses.replace(cfg, loss=loss.LossConfig(rule="interval", ratio_limits=(0.8, 1.2)))
    grpo_records, grpo_weights = update_records(model, optimizer, tokenizer, state, cfg, out, advantages)
    same_records, same_weights = update_records(model, optimizer, tokenizer, state, same_cfg, out, advantages)
    assert all(torch.equal(grpo_weights[name], same_weights[name]) for name in grpo_weights)
    for mine, theirs in zip(grpo_records, same_records):
        stopped = mine["region_low"] | mine["region_high"]
        assert np.array_equal(mine["w"], theirs["w"]) and np.array_equal(stopped, theirs["limit"])
    # two regions: identical ratios until the first update where some token is inside one and not the
    # other; the tokens whose decision differs there are exactly those
    diverged = 0
    for other in ("atr", "kl-atomic"):
        records, _ = update_records(model, optimizer, tokenizer, state, arms[other], out, advantages)
        for update, (mine, theirs) in enumerate(zip(grpo_records, records)):
            assert mine["update"][0] == theirs["update"][0] == update
            assert np.array_equal(mine["w"], theirs["w"]), (other, update)
            mu, w = (torch.as_tensor(mine[k], dtype=torch.float64) for k in ("mu", "w"))
            outward = torch.as_tensor(mine["advantage"], dtype=torch.float64) * (w - 1) > 0
            inside = {
                rule: loss.inside(loss.get_rule(c.rule), w.log(), mu.log(), c)
                for rule, c in (("grpo", cfg.loss), (other, arms[other].loss))
            }
            expected = ((inside["grpo"] != inside[other]) & outward).numpy()
            decided = {
                name: r["region_low"] | r["region_high"] | r["limit"] for name, r in (("g", mine), ("o", theirs))
            }
            assert np.array_equal(decided["g"] != decided["o"], expected), (other, update)
            if expected.any():  # from here on the weights differ, and so do the ratios
                diverged += 1
                break
        else:
            pytest.fail(f"grpo and {other} never made a different decision: the test says nothing")
    assert diverged == 2


def test_a_tiny_table_runs_end_to_end_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "cf"
    argv = [
        "--points",
        "0,1",
        "--rollouts",
        "2",
        "--out",
        str(out),
        "--fresh-samples",
        "2",
        "--log-tokens",
        "40",
        "--arms",
        "grpo,atr,limits,atr-eq",
        "--workers",
        "1",
        *study_flags(tiny_model_dir),
        "--",
        "--lora-rank",
        "4",
    ]
    counterfactual.main(argv)
    results = json.loads((out / "results.json").read_text())
    assert results["rollouts"] == 4 and set(results["means"]) == {"grpo", "atr", "limits", "atr-eq"}
    assert results["settings"]["rollout_prompts"] == 2  # the default: a rollout is a pilot step's prompts
    assert json.loads((out / "pilot" / "config.json").read_text())["prompts_per_step"] == 2
    # every rollout has prompts of its own, so each is its own unit; atr's and limits' regions hold grpo's
    rollouts = [json.loads(line) for p in (0, 1) for line in (out / "rollouts" / f"point-{p}.jsonl").open()]
    prompts = [prompt for line in rollouts for prompt in line["prompts"]]
    assert len(prompts) == len(set(prompts)) == 2 * len(rollouts)
    assert results["units"] == results["rollouts"] == 4
    assert (
        results["gaps"]["atr"]["clip"]["by_construction"] and results["gaps"]["limits"]["clip_all"]["by_construction"]
    )
    assert not results["gaps"]["atr"]["kl"]["by_construction"]
    calibration = results["calibration"]
    assert 0 < calibration["target"] < 1 and calibration["deltas"]["atr-eq"] > 0
    assert results["arms"]["atr-eq"][-2:] == ["--delta", f"{calibration['deltas']['atr-eq']:.6g}"]
    gap = results["gaps"]["atr"]["kl"]
    assert gap["n"] == 4 and math.isfinite(gap["mde"]) and gap["called"] == (gap["p_holm"] < 0.05)
    table = (out / "table.md").read_text()
    assert "| atr-eq |" in table and "Paired gaps to grpo" in table
    assert "Unit of analysis: the rollout, 4 of them" in table and "(by construction)" in table
    assert sorted(p.name for p in (out / "figures").glob("*.png")) == ["clip_buckets.png", "gaps.png"]
    assert sorted(p.name for p in (out / "pilot" / "points").iterdir()) == ["step-0", "step-1"]
    lines = [(out / "rollouts" / f"point-{p}.jsonl").read_text() for p in (0, 1)]
    counterfactual.main(argv)  # everything done: nothing runs again
    assert [(out / "rollouts" / f"point-{p}.jsonl").read_text() for p in (0, 1)] == lines
    with pytest.raises(SystemExit, match="other points"):
        counterfactual.main([*argv[:1], "0,2", *argv[2:]])


def test_rollouts_that_share_a_prompt_are_one_cluster():
    lines = [
        {"draw": 0, "prompts": ["a", "b"]},
        {"draw": 1, "prompts": ["c"]},
        {"draw": 2, "prompts": ["b", "d"]},
        {"draw": 3, "prompts": ["d"]},
        {"draw": 0},  # a line without its prompts: draw d had the same prompts at every point
        {"draw": 0},
    ]
    clusters = counterfactual.prompt_clusters(lines)
    assert clusters[0] == clusters[2] == clusters[3] and len({clusters[0], clusters[1], clusters[4]}) == 3
    assert clusters[4] == clusters[5]
    # the gap's units are the clusters: 3 here, not 6 rollouts
    arms = {"grpo": {m: 0.0 for m in [*counterfactual.MEASURES, *(f"clip[{b}]" for b in loss.MU_LABELS)]}}
    lines = [
        line | {"arms": {"grpo": arms["grpo"], "atr": {**arms["grpo"], "kl": float(i)}}} for i, line in enumerate(lines)
    ]
    summary = counterfactual.summarize(lines, ["grpo", "atr"])
    assert summary["gaps"]["atr"]["kl"].n == summary["units"] == 3 and summary["rollouts"] == 6


@pytest.mark.usefixtures("forked_commands")
def test_points_run_in_worker_processes_and_a_failed_one_is_named(tiny_model_dir, tmp_path, monkeypatch):
    """Workers are processes of their own, where the random model's rewards are all zero: the one draw allowed
    is skipped, the worker gives up, and the study says which point and where its output is."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "cf"
    argv = [
        "--points",
        "0,1",
        "--rollouts",
        "1",
        "--out",
        str(out),
        "--arms",
        "grpo,atr",
        "--workers",
        "2",
        "--max-draws",
        "1",
        *study_flags(tiny_model_dir),
        "--",
        "--lora-rank",
        "4",
    ]
    with pytest.raises(SystemExit, match=r"the worker of point [01] failed .*logs/point-[01]\.log") as failed:
        counterfactual.main(argv)
    # the first point to fail ends the other, whose output may not have reached its log yet
    point = re.search(r"point ([01])", str(failed.value)).group(1)
    log = (out / "logs" / f"point-{point}.log").read_text()
    assert "no acting token, skipped" in log and "gives no signal" in log


def test_arms_differ_in_the_loss_alone_and_bad_flags_fail_first(tiny_model_dir, tmp_path, capsys):
    arms = counterfactual.arm_configs(tiny_flags(tiny_model_dir), ["grpo", "gppo", "atr-eq"], {"atr-eq": 0.123})
    assert arms["gppo"].loss.rule == ("kl", "atomic") and arms["gppo"].loss.ratio_limits == (0.5, 10.0)
    assert arms["atr-eq"].loss.delta == 0.123 and arms["atr-eq"].lr == arms["grpo"].lr == 0.05
    assert arms["gppo"].prompts_per_step == 2  # without rollout_prompts: the pilot's
    small = counterfactual.arm_configs(tiny_flags(tiny_model_dir), ["grpo", "atr"], {}, rollout_prompts=1)
    assert {(cfg.prompts_per_step, cfg.rollout_batch) for cfg in small.values()} == {(1, 1)}
    for argv, message in (
        (["--arms", "atr,grpo"], "grpo must come first"),
        (["--arms", "grpo,nope"], "distinct arms"),
        (["--points", "a"], "--points a"),
        (["--rollouts", "0"], "--rollouts 0"),
        (["--rollout-prompts", "0"], "--rollout-prompts 0"),
        (["--point", "3"], "--point 3"),
    ):
        with pytest.raises(SystemExit):
            counterfactual.parse_args(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--lora-rank 0: the points are LoRA adapters"):
        counterfactual.main(["--out", str(tmp_path / "full"), *study_flags(tiny_model_dir), "--", "--lora-rank", "0"])
    assert not (tmp_path / "full").exists(), "refused before anything is written"
    shared = counterfactual.study.train_flags(counterfactual.parse_args([]), exclude=counterfactual.PILOT_ONLY)
    binding = counterfactual.study.SETTINGS["binding"]
    assert config.parse_args(shared)[0].updates_per_rollout == binding["updates_per_rollout"]
