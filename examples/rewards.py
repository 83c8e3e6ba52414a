"""Reward functions of your own, written as TRL takes them (see grading/scoring.py): keyword arguments in, one
number per completion out. Use them next to the built-in math reward:

    python train.py --reward-fn reward:math_reward --reward-fn examples/rewards.py:brevity \
        --reward-fn examples/rewards.py:restates_the_question --reward-weights 1,0.2,0.1

Each receives completions (text), completion_ids (token ids), prompts, and the dataset's columns by name
(problem, answer, and the arithmetic generator's kind); it takes what it needs and ignores the rest.
"""

import re

_QUESTION = re.compile(r"What is (.+)\?")


def brevity(completions: list[str], completion_ids: list[list[int]], **columns) -> list[float]:
    """A length penalty: 0 for a one-token reply, falling by 1/16 per further token, at most -1."""
    return [-min(1.0, (len(ids) - 1) / 16) for ids in completion_ids]


def restates_the_question(completions: list[str], problem: list[str], **columns) -> list[float]:
    """A format reward for the demo's "equation" template: 1 when the reply starts by restating the question's
    expression as an equation ("What is 7 + 5?" -> "7 + 5 = ..."), whether or not the result is right; None
    (not applicable) for a problem that is not of the form "What is ...?"."""
    scores = []
    for text, question in zip(completions, problem):
        match = _QUESTION.fullmatch(question.strip())
        scores.append(None if match is None else float(text.strip().startswith(match[1] + " =")))
    return scores
