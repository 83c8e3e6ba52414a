"""Reward functions of your own, as TRL takes them: `--reward-fn module:function`, repeatable, weighted by
--reward-weights, each called with the completions as text and the dataset's other columns by name, and
returning one float per completion.

    def length_penalty(completions, **columns) -> list[float]:
        return [-len(text) / 1000 for text in completions]

    python train.py --reward-fn reward:math_reward --reward-fn examples/rewards.py:length_penalty \\
        --reward-weights 1,0.5

A function receives prompts (each problem as the template poses it), completions (text), completion_ids
(token ids) and every column of its rows' problems by name: problem, answer, source, and whatever else the
dataset holds (None where a row lacks it). It returns one number per completion, or None where it does not
apply (it then adds nothing, as in TRL). The step's reward is the weighted sum. The built-in rewards are
two such functions: reward.math_reward (a math problem's answer checked; the default) and
sandbox.code_reward (a code problem's program run against its tests), each None on the other's rows;
verdicts, below, is the built-in verdict of a step that mixes them, which train.py hands both.

A function of reward.py runs in the trainer's process: it bounds its own time. Any other runs in a worker
process, so that a slow one is bounded like the answer checker: a call on N completions may take N x
--reward-timeout seconds; past that the worker is killed and the function is called again one completion
at a time, each with --reward-timeout, and a completion still past it scores 0 from that function, with a
warning naming the function and the rows. A function that raises, returns the wrong number of values or a
value that is not a finite number fails the step with one line (RewardFunctionError) naming the function
and the row.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import reward
from grading import pool, sandbox

IN_PROCESS = ("reward", "sandbox")  # modules whose functions bound their own time, called directly
BUILT_IN_MODULES = {"sandbox": "grading.sandbox"}  # the built-in rewards' short names (sandbox:code_reward)
_ROOT = str(Path(__file__).resolve().parent.parent)


class RewardFunctionError(Exception):
    """A reward function failed on a row: the step cannot be scored. The message is one line."""


# ----------------------------------------------------------------------------- finding a function


def check_spec(spec: str) -> None:
    """A ValueError naming --reward-fn unless spec reads module:function (module dotted, or a .py path)."""
    module, _, name = spec.rpartition(":")
    is_path = module.endswith(".py")
    if not module or not name.isidentifier() or not (is_path or all(p.isidentifier() for p in module.split("."))):
        raise ValueError(
            f"--reward-fn {spec!r}: expected module:function (such as reward:math_reward or "
            "my_rewards.py:length_penalty)"
        )


def load(spec: str) -> Callable:
    """The function a spec names: `package.module:function` (imported with the working directory on the
    path, as a script of your own would be) or `path/to/file.py:function`."""
    check_spec(spec)
    module_name, _, name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no such file {path}")
            module_spec = importlib.util.spec_from_file_location(f"_reward_fn_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(BUILT_IN_MODULES.get(module_name, module_name))
    except Exception as error:  # the user's module: any error it raises on import is theirs to see
        raise ValueError(f"--reward-fn {spec}: cannot import {module_name} ({type(error).__name__}: {error})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"--reward-fn {spec}: {module_name} has no function {name!r}")
    return function


def _values(result, count: int) -> list[float | None]:
    """A function's result as floats (None kept), or _BadResult saying which row is wrong and how."""
    try:
        values = list(result)
    except TypeError:
        raise _BadResult(f"returned {type(result).__name__}, not a list of numbers") from None
    if len(values) != count:
        raise _BadResult(f"returned {len(values)} values for {count} completions")
    numbers = []
    for row, value in enumerate(values):
        if value is None:
            numbers.append(None)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _BadResult(f"returned {value!r}", row, "not a number") from None
        if isinstance(value, (str, bytes)) or not math.isfinite(number):
            raise _BadResult(f"returned {value!r}", row, "not a finite number")
        numbers.append(number)
    return numbers


class _BadResult(Exception):
    """What a function returned that is not one number per completion: what, at which row (None: the whole
    result), and why that is wrong."""

    def __init__(self, what: str, row: int | None = None, why: str = ""):
        super().__init__(what)
        self.what, self.row, self.why = what, row, why

    def reply(self) -> tuple:
        return ("bad", self.what, self.row, self.why)


# ----------------------------------------------------------------------------- the worker process


def _serve() -> None:
    """Worker loop: one pickled job (spec, kwargs, count, working directory) in; ("ok", values),
    ("bad", what, row, why) or ("raised", message) out."""
    functions: dict[str, Callable] = {}

    def run(frame: bytes) -> bytes:
        spec, kwargs, count, cwd = pickle.loads(frame)
        try:
            if os.getcwd() != cwd:  # the trainer's, for relative paths and modules beside it
                os.chdir(cwd)
            if spec not in functions:
                functions[spec] = load(spec)
            reply = ("ok", _values(functions[spec](**kwargs), count))
        except _BadResult as bad:
            reply = bad.reply()
        except BaseException as error:  # the function's own failure, reported to the trainer
            reply = ("raised", f"{type(error).__name__}: {error}")
        return pickle.dumps(reply)

    pool.serve(run)


def _launch() -> pool.Launch:
    code = f"import sys; sys.path[:0] = [{_ROOT!r}, '']; from grading import scoring; scoring._serve()"
    return pool.Launch([sys.executable, "-c", code])


# One persistent process runs the reward functions; killed and replaced when a call runs past its time.
_POOL = pool.Pool(_launch)


def _call_worker(spec: str, kwargs: dict, count: int, timeout: float):
    """The worker's reply, or None when it ran past `timeout` seconds (the worker is then replaced)."""
    reply = _POOL.call(pickle.dumps((spec, kwargs, count, os.getcwd())), timeout)
    if isinstance(reply, pool.Failure):
        return None if reply.kind == "timeout" else ("raised", "the worker process died")
    return pickle.loads(reply)


# ----------------------------------------------------------------------------- scoring a step


class RewardFunctions:
    """The step's reward functions, their weights and time bound; call it on a step's completions."""

    def __init__(self, specs: Sequence[str], weights: Sequence[float] | None = None, timeout: float = 2.0):
        self.specs = tuple(specs)
        self.functions = [load(spec) for spec in self.specs]  # before anything slow: a typo fails now
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(self.specs)
        if len(self.weights) != len(self.specs):
            raise ValueError(f"--reward-weights: {len(self.weights)} weights for {len(self.specs)} functions")
        self.timeout = timeout
        short = [spec.rpartition(":")[2] for spec in self.specs]
        self.names = [name if short.count(name) == 1 else spec for name, spec in zip(short, self.specs)]

    def name_of(self, function: Callable) -> str | None:
        """The metric name of `function` among these, or None when it is not one of them."""
        return next((name for name, f in zip(self.names, self.functions) if f is function), None)

    def __call__(
        self,
        completions: list[str],
        columns: dict[str, list],
        where: str = "",
        group_size: int = 1,
        given: dict[str, list[float | None]] | None = None,
    ) -> tuple[list[float], dict[str, list[float]]]:
        """(the weighted sum per completion, each function's values by name, None read as 0).

        columns holds the keyword arguments besides completions (prompts, completion_ids, the dataset's
        columns), each a list aligned with completions. where and group_size name a failing row. given holds,
        by spec (such as "reward:math_reward"), the values of functions the caller has already computed
        (train.py grades the built-in rewards itself, with the run's code settings); those are not called."""
        totals, by_name, given = [0.0] * len(completions), {}, given or {}
        for spec, function, name, weight in zip(self.specs, self.functions, self.names, self.weights):
            values = (
                given[spec]
                if spec in given
                else self._call(
                    spec, function, {"completions": completions, **columns}, len(completions), where, group_size
                )
            )
            by_name[name] = [0.0 if v is None else v for v in values]
            totals = [total + weight * v for total, v in zip(totals, by_name[name])]
        return totals, by_name

    def _call(
        self, spec: str, function: Callable, kwargs: dict, count: int, where: str, group_size: int
    ) -> list[float | None]:
        reply = self._run(spec, function, kwargs, count, self.timeout * count)
        if reply is None:  # past the call's time: one completion at a time finds the slow ones
            return self._one_at_a_time(spec, function, kwargs, count, where, group_size)
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "bad":
            _, what, row, why = reply
            where_text = "" if row is None else f" on {_row(row, where, group_size, kwargs)}"
            raise RewardFunctionError(f"reward function {spec} {what}{where_text}" + (f", {why}" if why else ""))
        for row in range(count):  # it raised: the first row that raises alone is the one to name
            single = self._run(spec, function, _select(kwargs, row), 1, self.timeout)
            if single is not None and single[0] != "ok":
                self._fail(spec, single, row, where, group_size, kwargs)
        raise RewardFunctionError(
            f"reward function {spec} raised on the {count} completions of {where or 'a step'}"
            f" (no single row raises alone): {reply[1]}"
        )

    def _run(self, spec: str, function: Callable, kwargs: dict, count: int, timeout: float):
        """One call: in this process for IN_PROCESS modules, else in the worker with a deadline."""
        if spec.rpartition(":")[0] not in IN_PROCESS:
            return _call_worker(spec, kwargs, count, timeout)
        try:
            return ("ok", _values(function(**kwargs), count))
        except _BadResult as bad:
            return bad.reply()
        except Exception as error:
            return ("raised", f"{type(error).__name__}: {error}")

    @staticmethod
    def _fail(spec: str, reply: tuple, row: int, where: str, group_size: int, kwargs: dict):
        """The error of a call on one row that did not return a number."""
        if reply[0] == "bad":
            raise RewardFunctionError(
                f"reward function {spec} {reply[1]} on {_row(row, where, group_size, kwargs)}"
                + (f", {reply[3]}" if reply[3] else "")
            )
        raise RewardFunctionError(
            f"reward function {spec} raised on {_row(row, where, group_size, kwargs)}: {reply[1]}"
        )

    def _one_at_a_time(
        self, spec: str, function: Callable, kwargs: dict, count: int, where: str, group_size: int
    ) -> list[float | None]:
        values, slow = [], []
        for row in range(count):
            reply = self._run(spec, function, _select(kwargs, row), 1, self.timeout)
            if reply is None:
                slow.append(row)
                values.append(0.0)
            elif reply[0] == "ok":
                values.append(reply[1][0])
            else:
                self._fail(spec, reply, row, where, group_size, kwargs)
        if slow:
            warnings.warn(
                f"reward function {spec} took more than {self.timeout:g} s on {len(slow)} of {count} "
                f"completions of {where or 'a step'} (rows {', '.join(map(str, slow[:10]))}"
                f"{', ...' if len(slow) > 10 else ''}); they score 0 from it"
            )
        return values


def _select(kwargs: dict, row: int) -> dict:
    return {key: value[row : row + 1] for key, value in kwargs.items()}


def _row(row: int, where: str, group_size: int, kwargs: dict) -> str:
    """A row as a reader finds it: its index, its prompt and sample, and the start of its problem."""
    problem = (kwargs.get("problem") or [None] * (row + 1))[row]
    text = f"row {row}" + (f" of {where}" if where else "")
    text += f" (prompt {row // group_size}, completion {row % group_size}"
    return text + (f": {str(problem)[:60]!r})" if problem is not None else ")")


@functools.lru_cache(maxsize=8)
def functions(specs: tuple[str, ...], weights: tuple[float, ...] | None, timeout: float) -> RewardFunctions:
    """The RewardFunctions of a config, built (and its modules imported) once per process."""
    return RewardFunctions(specs, weights, timeout)


def columns_of(rows: Sequence[dict]) -> dict[str, list]:
    """The dataset's columns of some problems by name, each a list aligned with the rows (None where absent)."""
    keys = dict.fromkeys(key for row in rows for key in row)
    return {key: [row.get(key) for row in rows] for key in keys}


# ----------------------------------------------------------------------------- the built-in verdict


def verdicts(
    completions: list[str],
    rows: Sequence[dict],
    *,
    template: str | None = None,
    open_thought: bool = False,
    code_fraction: bool = False,
    code_limits: sandbox.Limits | None = None,
) -> tuple[list[float], list[sandbox.Grade | None]]:
    """The built-in verdict of each completion, by its row's task: a math problem's answer checked against
    its "answer" (reward.reward, an echo of the row's "problem" refused), a code problem's program (task
    "code") run against its tests (sandbox.reward: 1.0 when every test passes, the share passed with
    code_fraction, within code_limits). Only the answer part after a thought is read (reward.split_thinking).
    This is what train.py's accuracy and eval.py's Mean@k count, whatever the reward functions are, and
    what it hands reward.math_reward and sandbox.code_reward instead of calling them again. Returns the
    verdicts and each row's sandbox.Grade (None for math): the reasons behind the code metrics."""
    code = [i for i, row in enumerate(rows) if row.get("task") == "code"]
    math_rows = [i for i, row in enumerate(rows) if row.get("task") != "code"]
    for i in math_rows:
        if not isinstance(rows[i].get("answer"), str):
            raise ValueError(f'row {i}: a problem with neither a text "answer" nor "task": "code"')
    values, found = [0.0] * len(rows), [None] * len(rows)
    checked = reward.reward(
        [completions[i] for i in math_rows],
        [rows[i]["answer"] for i in math_rows],
        problems=[rows[i].get("problem") for i in math_rows],
        template=template,
        open_thought=open_thought,
    )
    for i, value in zip(math_rows, checked):
        values[i] = value
    if code:
        answers = [reward.split_thinking(completions[i], open_thought).answer or "" for i in code]  # "": none
        programs = sandbox.grade_completions(answers, [rows[i] for i in code], limits=code_limits or sandbox.Limits())
        for i, grade in zip(code, programs):
            values[i], found[i] = grade.reward(code_fraction), grade
    return values, found
