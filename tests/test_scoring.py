"""Tests for scoring.py: reward functions of your own get TRL's arguments, add up by weight, and fail or run
slow in ways that name them and their rows."""

import time
import warnings
from pathlib import Path

import pytest

from grading import scoring

HERE = Path(__file__).resolve().parent.parent
EXAMPLES = HERE / "examples" / "rewards.py"

USER_MODULE = """
import time

def echo_columns(completions, prompts, completion_ids, problem, answer, level=None, **rest):
    # every argument TRL passes, by name: a number that encodes what arrived
    return [len(c) + 100 * len(p) + 10_000 * len(ids) + (0.5 if level[i] is None else level[i]) + float(a)
            for i, (c, p, ids, a) in enumerate(zip(completions, prompts, completion_ids, answer))]

def half_unknown(completions, **columns):
    return [None if i % 2 else 1.0 for i in range(len(completions))]

def raises_on_seven(completions, **columns):
    return [1 / (len(c) - 7) for c in completions]

def one_too_few(completions, **columns):
    return [0.0] * (len(completions) - 1)

def a_word(completions, **columns):
    return [1.0 if "good" in c else "bad" for c in completions]

def nan_on_b(completions, **columns):
    return [float("nan") if c == "b" else 0.0 for c in completions]

def not_a_list(completions, **columns):
    return 3.0

def slow_on_wait(completions, **columns):
    for c in completions:
        if "wait" in c:
            time.sleep(30)
    return [1.0] * len(completions)

def prints(completions, **columns):
    print("a print inside a reward function")
    return [2.0] * len(completions)
"""


@pytest.fixture(scope="module")
def module(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "user_rewards.py"
    path.write_text(USER_MODULE)
    return path


def columns(completions: list[str], **extra) -> dict:
    rows = [
        {"problem": f"What is {i} + 1?", "answer": str(i + 1), **{k: v[i] for k, v in extra.items()}}
        for i in range(len(completions))
    ]
    return {
        "prompts": [row["problem"] + "!" for row in rows],
        "completion_ids": [[0] * (i + 1) for i in range(len(rows))],
        **scoring.columns_of(rows),
    }


def test_functions_get_trl_arguments_by_name_and_add_up_by_weight(module):
    texts = ["a", "bb", "ccc"]
    functions = scoring.RewardFunctions([f"{module}:echo_columns", f"{module}:half_unknown"], weights=(1.0, 10.0))
    totals, by_name = functions(texts, columns(texts, level=[None, 2, 3]))
    expected = [
        len(c) + 100 * len(f"What is {i} + 1?!") + 10_000 * (i + 1) + level + (i + 1)
        for i, (c, level) in enumerate(zip(texts, [0.5, 2, 3]))
    ]
    assert by_name["echo_columns"] == expected
    assert by_name["half_unknown"] == [1.0, 0.0, 1.0], "None (not applicable) adds nothing, as in TRL"
    assert totals == [e + 10 * h for e, h in zip(expected, by_name["half_unknown"])]
    assert functions.names == ["echo_columns", "half_unknown"]


def test_the_built_in_math_reward_is_one_such_function():
    functions = scoring.RewardFunctions(["reward:math_reward"])
    texts = ["The answer is 12", "\\boxed{13}", "I do not know"]
    totals, by_name = functions(texts, {"answer": ["12", "12", "12"], "problem": ["What is 7 + 5?"] * 3})
    assert totals == by_name["math_reward"] == [1.0, 0.0, 0.0]
    assert functions.name_of(scoring.load("reward:math_reward")) == "math_reward"


def test_verdicts_grade_each_row_by_its_task_so_math_and_code_mix():
    """A math row by its answer (an echo of its problem refused), a code row by running its program in
    sandbox.py; the two built-in reward functions each grade their own rows and leave the other's None."""
    from grading import sandbox

    code = {"task": "code", "problem": "Print 7.", "tests": [{"input": "", "output": "7"}]}
    rows = [{"problem": "What is 2 + 2?", "answer": "4"}, {"problem": "What is 2 + 3?", "answer": "5"}, code, code]
    completions = ["\\boxed{4}", "2 + 3", "```python\nprint(7)\n```", "```python\nprint(8)\n```"]
    try:
        values, grades = scoring.verdicts(completions, rows)
        assert values == [1.0, 0.0, 1.0, 0.0]
    except sandbox.SandboxUnavailable as error:
        pytest.skip(str(error))
    assert grades[:2] == [None, None] and [g.reason for g in grades[2:]] == [None, "wrong_answer"]
    functions = scoring.RewardFunctions(["reward:math_reward", "sandbox:code_reward"])
    totals, by_name = functions(completions, scoring.columns_of(rows))
    assert totals == [1.0, 0.0, 1.0, 0.0] and by_name == {
        "math_reward": [1.0, 0.0, 0.0, 0.0],
        "code_reward": [0.0, 0.0, 1.0, 0.0],
    }
    with pytest.raises(ValueError, match="row 0: a problem with neither"):
        scoring.verdicts(["x"], [{"problem": "no answer"}])


def test_the_worked_examples():
    brevity, restates = scoring.load(f"{EXAMPLES}:brevity"), scoring.load(f"{EXAMPLES}:restates_the_question")
    assert brevity(["7", "7 + 5 = 12", "x" * 80], completion_ids=[[1], [1] * 9, [1] * 40]) == [0.0, -0.5, -1.0]
    assert restates(
        ["7 + 5 = 12", "12", " 7 + 5 = 13", "anything"],
        problem=["What is 7 + 5?", "What is 7 + 5?", "What is 7 + 5?", "Solve x^2 = 4."],
    ) == [1.0, 0.0, 1.0, None]
    # and through the worker, as train.py calls them
    functions = scoring.RewardFunctions(
        [f"{EXAMPLES}:brevity", f"{EXAMPLES}:restates_the_question"], weights=(1.0, 0.5)
    )
    texts = ["1 + 1 = 2", "2"]
    totals, _ = functions(texts, {**columns(texts), "completion_ids": [[1] * 17, [1]]})
    assert totals == [-1.0 + 0.5 * 0.0, 0.0], "'What is 0 + 1?' is not restated by '1 + 1 = 2'"


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "raises_on_seven",
            r"raises_on_seven raised on row 2 of step 3 \(prompt 1, completion 0: 'What is 2 \+ 1\?'\): "
            r"ZeroDivisionError: division by zero",
        ),
        ("one_too_few", r"one_too_few returned 3 values for 4 completions$"),
        ("a_word", r"a_word returned 'bad' on row 1 of step 3 .*, not a number"),
        ("nan_on_b", r"nan_on_b returned nan on row 1 of step 3 .*, not a finite number"),
        ("not_a_list", r"not_a_list returned float, not a list of numbers"),
    ],
)
def test_a_failing_function_fails_the_step_in_one_line_naming_it_and_the_row(module, name, message):
    texts = ["good", "b", "seven!!", "good"]
    functions = scoring.RewardFunctions([f"{module}:{name}"])
    with pytest.raises(scoring.RewardFunctionError, match=message) as error:
        functions(texts, columns(texts), where="step 3", group_size=2)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"reward function {module}:{name} ")


def test_a_slow_function_is_bounded_and_its_slow_rows_score_zero(module):
    texts = ["fast", "please wait", "fast", "fast"]
    functions = scoring.RewardFunctions([f"{module}:slow_on_wait"], timeout=0.4)
    start = time.monotonic()
    with pytest.warns(
        UserWarning,
        match=r"slow_on_wait took more than 0.4 s on 1 of 4 completions of step 1 "
        r"\(rows 1\); they score 0 from it",
    ):
        totals, _ = functions(texts, columns(texts), where="step 1")
    # 4 x 0.4 s for the call, then one completion at a time: the slow one waits its 0.4 s, not 30
    assert totals == [1.0, 0.0, 1.0, 1.0] and time.monotonic() - start < 10
    with warnings.catch_warnings():  # a replaced worker serves the next call
        warnings.simplefilter("error")
        assert functions(["fast"], columns(["fast"]))[0] == [1.0]


def test_a_print_inside_a_function_does_not_break_the_worker(module, capfd):
    scoring._POOL.close()  # a worker started now writes to this test's captured stderr
    functions = scoring.RewardFunctions([f"{module}:prints"])
    assert functions(["x", "y"], columns(["x", "y"]))[0] == [2.0, 2.0]
    assert "a print inside a reward function" in capfd.readouterr().err


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon", r"--reward-fn 'no_colon': expected module:function"),
        ("a-b:c", r"expected module:function"),
        (
            "no_such_module_xyz:f",
            r"--reward-fn no_such_module_xyz:f: cannot import no_such_module_xyz "
            r"\(ModuleNotFoundError",
        ),
        ("reward:no_such_function", r"--reward-fn reward:no_such_function: reward has no function 'no_such_function'"),
        ("missing/file.py:f", r"cannot import missing/file.py \(FileNotFoundError: no such file missing/file.py\)"),
    ],
)
def test_a_spec_that_names_no_function_fails_before_anything_runs(spec, message):
    with pytest.raises(ValueError, match=message):
        scoring.RewardFunctions([spec])


def test_a_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_here.py").write_text(
        "def one(completions, **columns):\n    return [1] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    functions = scoring.RewardFunctions(["my_rewards_here:one", "my_rewards_here:one"])
    assert functions.names == ["my_rewards_here:one", "my_rewards_here:one"], "twins are named by their spec"
    assert functions(["a"], {})[0] == [2.0]
