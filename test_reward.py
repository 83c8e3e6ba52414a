"""Tests for reward.py: answer conventions of MATH, AIME, AMC and GSM8K, hostile output, real data."""

import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import reward
from reward import extract_answer, grade

# (answer or completion, reference, expected). Every rule is checked in both directions: equal and not.
CASES = [
    # plain numbers: GSM8K, AIME leading zeros, thousands separators vs lists, tolerance, trailing period
    ("#### 42", "42", True),
    ("#### 41", "42", False),
    ("\\boxed{004}", "4", True),
    ("\\boxed{4}", "004", True),
    ("\\boxed{040}", "4", False),
    ("7,425,000", "7425000", True),
    ("\\boxed{7425000}", "7,425,000", True),
    ("11111111100", "11,\\! 111,\\! 111,\\! 100", True),
    ("32348", "\\$32,\\!348", True),
    ("\\boxed{1{,}024}", "1024", True),
    ("1, 234", "1234", False),
    ("(100,200)", "100200", False),
    ("18.00", "18", True),
    ("5.001", "5", False),
    ("5", "5.001", False),
    ("0.333333333333", "\\frac{1}{3}", True),
    ("0.3333", "\\frac{1}{3}", False),
    ("42.", "42", True),
    ("-3", "3", False),
    (".35625", "0.35625", True),
    # fractions, including LaTeX's one-token arguments and mixed numbers
    ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
    ("\\frac34", "0.75", True),
    ("\\tfrac{9}{19}", "\\frac9{19}", True),
    ("\\frac{270}{7}", "\\frac{270}7\\text{ degrees}", True),
    ("3/4", "\\frac{4}{3}", False),
    ("1\\frac{4}{5}", "\\frac{9}{5}", True),
    ("137.5", "137 \\frac{1}{2}", True),
    ("\\frac{1}{2004!}", "\\frac{1}{2006!}", False),
    ("\\frac{1}{2006!}", "\\frac{1}{2006 \\cdot 2005 \\cdot 2004!}", True),
    # radicals and constants
    ("\\sqrt3", "\\sqrt{3}", True),
    ("11\\sqrt2", "11\\sqrt{2}", True),
    ("\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt{3}}{3}", True),
    ("\\sqrt{20}", "2\\sqrt{5}", True),
    ("\\sqrt{10}", "2\\sqrt{5}", False),
    ("1.4142", "\\sqrt{2}", False),
    ("2\\pi", "\\frac{4\\pi}{2}", True),
    ("3.14", "\\pi", False),
    # units, degrees, percent, money
    ("90", "90^\\circ", True),
    ("90^{\\circ}", "90", True),
    ("106°", "106^\\circ", True),
    ("96", "106^\\circ", False),
    ("25\\%", "25", True),
    ("15", "15\\mbox{ cm}^2", True),
    ("864 square inches", "864 \\mbox{ inches}^2", True),
    ("5.4", "5.4 \\text{ cents}", True),
    ("\\boxed{1.5\\text{ m}}", "1.5", True),
    ("18.9", "\\$18.90", True),
    ("18 dollars", "18", True),
    ("20 dollars", "18", False),
    # "x = 5" vs "5", equations up to a nonzero factor, inequalities up to flipping
    ("x = 5", "5", True),
    ("5", "x=5", True),
    ("x = 6", "x=5", False),
    ("x = 2 + 3 = 5", "5", True),
    ("2x - y + 3 = 0", "y = 2x + 3", True),
    ("4x - 2y + 6 = 0", "y = 2x + 3", True),
    ("y = 2x - 3", "y = 2x + 3", False),
    ("-10x + 14y - 22z - 8 = 0", "5x - 7y + 11z + 4 = 0", True),
    ("3 < x", "x > 3", True),
    ("x \\geq 3", "3 \\le x", True),
    ("-2x < -6", "x > 3", True),
    ("x \\ge 3", "x > 3", False),
    ("x < 3", "x > 3", False),
    # complex numbers and expressions
    ("-5i + 6", "6 - 5i", True),
    ("6 + 5i", "6 - 5i", False),
    ("-q + p", "p - q", True),
    ("ab + 2a + 5b + 10", "(a+5)(b+2)", True),
    ("2(k+1)", "2k+2", True),
    ("\\frac{\\cos x}{\\sin x}", "\\cot x", True),
    ("(x-1)(x+1)", "x^2 - 1", True),
    ("(x-1)(x+1)", "x^2 + 1", False),
    ("x^{-1}", "\\frac{1}{x}", True),
    ("|x - 1|", "|1 - x|", True),
    ("\\log_2 8", "3", True),
    ("2/0", "1/0", False),
    # tuples keep order, lists and sets do not, intervals keep their ends
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("(4, 2)", "(2, 4)", False),
    ("7, 5, 3", "3, 5, 7", True),
    ("\\{1, -2\\}", "-2, 1", True),
    ("1", "1,-2", False),
    ("[-2, 7]", "x \\in [-2,7]", True),
    ("(-2, 7]", "[-2, 7]", False),
    ("\\left(3,4\\right]", "(3,4]", True),
    ("(3, \\infty) \\cup (-\\infty, 2)", "(-\\infty, 2) \\cup (3, \\infty)", True),
    ("(-\\infty, 2] \\cup (3, \\infty)", "(-\\infty, 2) \\cup (3, \\infty)", False),
    ("1 + \\sqrt{19}, 1 - \\sqrt{19}", "1 \\pm \\sqrt{19}", True),
    ("1 + \\sqrt{19}", "1 \\pm \\sqrt{19}", False),
    ("-2, 1 - \\sqrt{5}, 1 + \\sqrt{5}", "\\{1\\pm\\sqrt{5},-2\\}", True),
    # matrices elementwise; a column vector may be written as a tuple
    ("\\begin{bmatrix} -1 & 0 \\\\ 0 & -1 \\end{bmatrix}", "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}", True),
    ("\\begin{pmatrix} 0 & -1 \\\\ -1 & 0 \\end{pmatrix}", "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}", False),
    ("\\begin{pmatrix} -\\frac{1}{3} \\\\ \\frac23 \\\\ \\frac{5}{3} \\end{pmatrix}",
     "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}", True),
    ("(-1/3, 2/3, 5/3)", "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}", True),
    ("(2/3, -1/3, 5/3)", "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}", False),
    # words, multiple choice (AMC), bases
    ("Evelyn", "\\text{Evelyn}", True),
    ("Navin", "\\text{Evelyn}", False),
    ("East", "\\text{east}", True),
    ("\\textbf{(B)}", "\\text{(B)}", True),
    ("B", "\\text{(B)}", True),
    ("(C)", "\\text{(B)}", False),
    ("52", "52_8", True),
    ("42", "52_8", False),
    # wrappers and extraction
    ("$\\boxed{12}$", "12", True),
    ("\\fbox{12}", "12", True),
    ("\\boxed 5", "5", True),
    ("\\[ \\frac{1}{2} \\]", "0.5", True),
    ("\\boxed{2} and \\boxed{3}", "2, 3", True),
    ("\\boxed{2}, then we check more cases and find \\boxed{3}", "2, 3", False),
    ("Answer: $\\frac{1}{2}$", "\\frac12", True),
    ("**Final Answer:** 7", "7", True),
    ("Answer: 8", "7", False),
    ("We compute the area.\nThe area is $\\frac{1}{2}$.", "\\frac{1}{2}", True),
    ("", "7", False),
]


@pytest.mark.parametrize("answer, reference, expected", CASES)
def test_grade_cases(answer, reference, expected):
    assert grade(answer, reference) is expected


def test_enough_cases_in_both_directions():
    assert len(CASES) >= 60
    assert sum(expected for *_, expected in CASES) >= 30 and sum(not e for *_, e in CASES) >= 30


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\boxed{7}}", "\\boxed{7}"),
    ("first \\boxed{1}, later we see the real one \\boxed{2}", "2"),
    ("\\boxed{3} \\boxed{4}", "3, 4"),
    ("think...\nAnswer: 5\n", "5"),
    ("Answer: the total is $42$ dollars.", "42"),
    ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "18"),
    ("$x = 3$, so the total is 12.", "12"),
    ("The sum is 1,234 in all.\nWe are done.", "1,234"),
    ("x = 5", "x = 5"),
    ("no numbers here, just words", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_smollm2_style_completion():
    completion = "To find the total, we add the apples.\n17 + 25 = 42.\nSo, Tom has 42 apples in total."
    assert grade(completion, "42") and not grade(completion, "43")
    assert grade("17 + 25 = 42.", "42") and not grade("17 + 25 = 43.", "42")


def test_qwen3_style_completion():
    completion = (
        "<think>\nOkay, let me see. The probability of drawing a red ball first is 6/8, maybe \\boxed{6/8}? "
        "Wait, the question asks for the second draw too. Let me recompute: 6/8 * 5/7 = 30/56 = 15/28. Hmm, "
        "no, the balls are replaced, so it is 6/8 = 3/4 each time... I think the answer is 3/4.\n</think>\n\n"
        "Each draw is independent because the ball is replaced, so\n"
        "$$P = \\frac{6}{8} = \\frac{3}{4}.$$\n\n**Final answer:** $\\boxed{\\dfrac{3}{4}}$"
    )
    assert grade(completion, "\\frac{3}{4}") and grade(completion, "0.75")
    assert not grade(completion, "\\frac{15}{28}")


def test_reward_format_term_is_separate():
    completions = ["so \\boxed{42}", "work\nAnswer: 42", "42", "so \\boxed{41}"]
    references = ["42"] * 4
    assert reward.reward(completions, references) == [1.0, 1.0, 1.0, 0.0]
    assert reward.reward(completions, references, format_weight=0.5, answer_format="boxed") == [1.5, 1.0, 1.0, 0.5]
    assert reward.reward(completions, references, format_weight=0.5, answer_format="answer") == [1.0, 1.5, 1.0, 0.0]
    assert reward.reward(completions, references, format_weight=0.5) == [1.5, 1.5, 1.0, 0.5]
    assert reward.reward(["\\boxed{42"], ["42"], format_weight=0.5, answer_format="boxed") == [0.0]  # unclosed box


@pytest.mark.parametrize("kwargs, argument", [
    (dict(completions=["1"], references=[]), "completions and references"),
    (dict(completions=["1"], references=["1"], answer_format="xml"), "answer_format"),
    (dict(completions=["1"], references=["1"], workers=0), "workers"),
    (dict(completions=[None], references=["1"]), "completions\\[0\\]"),
])
def test_reward_rejects_bad_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        reward.reward(**kwargs)


def test_fast_path_needs_neither_sympy_nor_workers():
    code = ("import json, sys, reward; scores = reward.reward(['#### 42', '\\\\boxed{0.5}', '7,000', '#### 41', 'x = 5'], "
            "['42', '\\\\frac12', '7000', '42', '5']); print(json.dumps([scores, 'sympy' in sys.modules, "
            "len(reward._POOL.procs)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out) == [[1.0, 1.0, 1.0, 0.0, 1.0], False, 0]


HANG = ("\\boxed{(x+y+z+w)^{40}}", "(x+y+z+w+1)^{40}")  # sympy needs several seconds to simplify the difference


def test_timeout_kills_and_replaces_the_worker():
    start = time.monotonic()
    assert not grade(*HANG, timeout=0.5)
    assert time.monotonic() - start < 0.5 + 5  # + a fresh worker's start-up on a loaded machine
    assert grade("\\sqrt{8}", "2\\sqrt{2}")  # the replacement works


def test_grading_works_off_the_main_thread():
    results = []  # signal.alarm based timeouts fail here; worker processes do not
    thread = threading.Thread(target=lambda: results.extend([grade(*HANG, timeout=0.5), grade("\\sqrt{4}", "2")]))
    thread.start()
    thread.join(timeout=30)
    assert results == [False, True]


@pytest.mark.parametrize("make_payload", [
    lambda path: f"\\boxed{{__import__('os').system('touch {path}')}}",
    lambda path: f"Answer: __import__('os').system('touch {path}')",
    lambda path: f"x = exec(\"open('{path}', 'w')\")",
    lambda path: f"\\boxed{{(lambda: open('{path}', 'w'))()}}",
    lambda path: f"\\boxed{{().__class__.__base__.__subclasses__()[0]('{path}')}}",
    lambda path: "\\boxed{10^{10^{10}}}",
    lambda path: "\\boxed{(10^8)!}",
    lambda path: "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    lambda path: "\\boxed{\\binom{10^{9}}{5 \\cdot 10^{8}}}",
    lambda path: "\\boxed{" + "{" * 10_000,
    lambda path: "\\boxed{" + "(" * 600 + "1" + ")" * 600 + "}",
    lambda path: "\\boxed{" + "(," * 660 + ")" * 660 + "}",
    lambda path: "7" * 100_000,
    lambda path: ("\\boxed{" + "x+" * 50_000 + "1}"),
    lambda path: "$" * 50_000 + "\\(" * 20_000 + "#" * 30_000,
])
def test_hostile_output_is_wrong_fast_and_inert(make_payload, tmp_path):
    marker = tmp_path / "executed"
    start = time.monotonic()
    assert not grade(make_payload(marker), "3", timeout=1.0)
    assert time.monotonic() - start < 1.0 + 5
    assert not marker.exists()


def test_explosive_answers_equal_to_themselves_use_exact_text():
    assert grade("\\boxed{10^{10^{10}}}", "10^{10^{10}}") and grade("\\boxed{(10^8)!}", "(10^8)!")


# ----------------------------------------------------------------------------- real data (third-party)

def _rows(shared_data: Path, name: str) -> list[dict]:
    with open(shared_data / name) as f:
        return [json.loads(line) for line in f]


def test_math500_answers_grade_equal_to_themselves(shared_data):
    answers = [row["answer"] for row in _rows(shared_data, "math500.jsonl")]
    respelled = [f"Thus the answer is $\\boxed{{{a.replace(chr(92) + 'frac', chr(92) + 'dfrac')}}}$." for a in answers]
    assert reward.reward(respelled, answers) == [1.0] * len(answers)


def test_math500_shuffled_references_rarely_match(shared_data):
    answers = [row["answer"] for row in _rows(shared_data, "math500.jsonl")]
    others = answers[1:] + answers[:1]
    random.Random(0).shuffle(others)
    scores = reward.reward(answers, others)
    identical = sum(a.replace(" ", "") == b.replace(" ", "") for a, b in zip(answers, others))
    assert identical <= sum(scores) <= identical + 5  # the few extra: equal values spelled differently


def test_gsm8k_answers_match_exactly_when_values_do(shared_data):
    answers = [row["answer"] for row in _rows(shared_data, "gsm8k_test.jsonl")]
    others = list(answers)
    random.Random(1).shuffle(others)
    completions = [f"The answer follows.\n#### {a}" for a in answers]
    assert reward.reward(completions, answers) == [1.0] * len(answers)
    assert reward.reward(completions, others) == [float(int(a) == int(b)) for a, b in zip(answers, others)]


def test_competition_integer_answers(shared_data):
    rows = _rows(shared_data, "aime24.jsonl") + _rows(shared_data, "aime25.jsonl") + _rows(shared_data, "amc23.jsonl")
    answers = [row["answer"] for row in rows]
    padded = [f"The answer is $\\boxed{{{int(a):03d}}}$" for a in answers]  # AIME answer sheets use 3 digits
    assert reward.reward(padded, answers) == [1.0] * len(answers)
    dapo = [row["answer"] for row in _rows(shared_data, "dapo_math_17k.jsonl")[:2000]]
    assert reward.reward([f"...\nAnswer: {a}" for a in dapo], dapo) == [1.0] * len(dapo)
