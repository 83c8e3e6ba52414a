"""Tests for reward.py: answer conventions of MATH, AIME, AMC and GSM8K, hostile output, real data."""

import json
import math
import random
import subprocess
import sys
import threading
import time
import warnings
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
    ("0.3333", "\\frac{1}{3}", True),  # a decimal is equal within half a unit of its last written place
    ("0.3334", "\\frac{1}{3}", False),
    ("0.33", "\\frac{1}{3}", False),  # too few digits to stand for 1/3
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
    ("1.4142", "\\sqrt{2}", True),
    ("1.4143", "\\sqrt{2}", False),
    ("3.1416", "\\pi", True),
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
    (
        "\\begin{pmatrix} -\\frac{1}{3} \\\\ \\frac23 \\\\ \\frac{5}{3} \\end{pmatrix}",
        "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}",
        True,
    ),
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


# The kinds of issue 15, each rule of equivalence with a near miss that must stay unequal.
KIND_CASES = [
    # exact values compare exactly, however large; decimals only within their written precision
    ("1000000008", "1000000007", False),
    ("\\boxed{1000000007}", "1,000,000,007", True),
    ("123456789012345678901", "123456789012345678902", False),
    ("\\boxed{2006! + 1}", "2006!", False),
    ("\\boxed{2 \\cdot 1003!}", "2006 \\cdot 1002!", True),
    ("2.6667", "\\frac{8}{3}", True),
    ("2.6666", "\\frac{8}{3}", False),
    ("5.0001", "5", False),
    ("16386.169", "16386.17", True),
    ("16386.16", "16386.17", False),
    # a number equal to an expression is an equation, not "computation = answer"
    ("11a+c", "7 = 11a+c", False),
    ("11a + c = 7", "7 = 11a+c", True),
    ("7", "7 = 11a+c", False),
    # several answers: boxes joined by connectors, all gold boxes, or, ;, "and" without an empty item
    ("\\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}", "1, -2", True),
    ("\\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}", "1", False),
    ("$x = \\boxed{1}$ or $x = \\boxed{2}$", "1, 2", True),
    ("\\boxed{1}; \\boxed{2}", "2", False),
    ("first \\boxed{1}. Hmm, no: it is \\boxed{2}", "2", True),
    ("\\boxed{3}", "\\boxed{1} and \\boxed{3}", False),
    ("3, 1", "\\boxed{1} and \\boxed{3}", True),
    ("(1, 2) or (3, 4)", "(3,4), (1,2)", True),
    ("(1, 2) or (4, 3)", "(3,4), (1,2)", False),
    ("1; 2", "2, 1", True),
    ("19, 46, \\text{ and } 82", "19, 46, 82", True),
    ("19, 46, \\text{ and } 82", "19, 46", False),
    ("1, 1, 2", "2, 1", True),  # a set: a repeated element is not another answer
    ("(1, 1, 2)", "(1, 2)", False),  # a tuple keeps its order and length
    # labelled answers
    ("(p,q)=(3,2)", "(3,2)", True),
    ("(p,q)=(2,3)", "(3,2)", False),
    ("|AB|=1", "1", True),
    ("|AB|=2", "1", False),
    ("AB=4, CD=5", "4, 5", True),
    ("AB=4, CD=6", "4, 5", False),
    ("S_{MBCN}:S=7:32", "7:32", True),
    ("S_{MBCN}:S=7:31", "7:32", False),
    ("f(x)=2x+3", "y=2x+3", True),
    ("f(x)=2x-3", "y=2x+3", False),
    ("x=3", "y=3", False),  # different unknowns: a different answer (only y and f(x) name one function)
    # notation
    ("{1, 3}", "\\{3, 1\\}", True),
    ("{1, 3}", "\\{1, 4\\}", False),
    ("\\pm 2", "2, -2", True),
    ("\\pm 2", "2", False),
    ("x \\neq 3", "x \\ne 3", True),
    ("x \\neq 3", "x = 3", False),
    ("x \\approx 11", "11", True),
    ("x \\approx 12", "11", False),
    ("\\sqrt{2} \\approx 1.41", "\\sqrt{2}", True),
    ("\\textnormal{Evelyn}", "\\text{Evelyn}", True),
    ("126\\textnormal{ miles}", "125", False),
    (r"\left[\begin{array}{cc}1 & 2 \\ 3 & 4\end{array}\right]", r"\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}", True),
    (r"\left[\begin{array}{cc}1 & 2 \\ 4 & 3\end{array}\right]", r"\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}", False),
    ("(\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix})", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
    ("\\sum_{k=1}^{10} k^2", "385", True),
    ("\\sum_{k=1}^{10} k^2", "386", False),
    ("\\sum_{k=1}^{n} k", "5", False),  # symbolic bounds are not evaluated
    ("64 square feet", "64", True),
    ("65 square feet", "64", False),
    ("0<f(x)<1", "(0,1)", True),
    ("0 \\le f(x)<1", "(0,1)", False),
    ("x \\ge 2", "[2, \\infty)", True),
    ("x > 2", "[2, \\infty)", False),
    ("-2 \\le x \\le 7", "[-2,7]", True),
    ("7 \\ge x \\ge -2", "x \\in [-2, 7]", True),
    ("-2 < x \\le 7", "[-2,7]", False),
    ("\\sqrt{1/n}", "\\frac{1}{\\sqrt n}", True),
    ("\\sqrt{1/n}", "\\frac{1}{n}", False),
    ("|x|", "x", False),
    ("2.718", "e", True),  # e is Euler's number
    ("2.71", "e", False),
    ("\\frac{1}{\\mathrm{e}}", "e^{-1}", True),
    ("\\varnothing", "\\emptyset", True),
    ("\\{0\\}", "\\emptyset", False),
    ("x \\in \\mathbb{R}", "(-\\infty, \\infty)", True),
    ("\\mathbb{R}", "(0, \\infty)", False),
    ("2.5e-3", "0.0025", True),
    ("2.5e-3", "0.025", False),
    ("x \\neq -2", "(-\\infty, -2) \\cup (-2, \\infty)", True),
    ("x \\neq 2", "(-\\infty, -2) \\cup (-2, \\infty)", False),
    ("m\\angle A = 30^\\circ", "30", True),
    ("a=2, b=3", "(2,3)", True),
    ("a=3, b=2", "(2,3)", False),
    ("1,22", "1.22", True),  # a decimal comma, when the other side is a decimal
    ("1, 22", "1.22", False),
    ("-2,1", "1,-2", True),  # and a list otherwise
    # extraction from prose
    ("So we have \\boxed{255} left. Final Answer: The final answer is $10,455$. I hope it is correct.", "10455", True),
    ("The final answer is 7. Let me double check: no, it is \\boxed{8}", "8", True),
    ("The final answer is 7. Let me double check: no, it is \\boxed{8}", "7", False),
    ("Answer: \\[ 9 \\]", "9", True),
    ("Answer: \\[ 9 \\]", "8", False),
    ("\\boxed{5}", "We add 2 and 3 to get 5 apples in total, which is the number of apples that Tom has now.", True),
    ("\\boxed{6}", "We add 2 and 3 to get 5 apples in total, which is the number of apples that Tom has now.", False),
    ("La respuesta es 42.", "42", True),
    ("答案是 $\\frac{1}{2}$", "0.5", True),
    ("Die Antwort ist 41.", "42", False),
    ("La respuesta correcta es 12.", "12", True),
    ("Die Lösung lautet 7.", "8", False),
    ("答えは 3 です", "3", True),
    ("La réponse est 2,5.", "2.5", True),
    ("La réponse est 2,5.", "2.6", False),
]


@pytest.mark.parametrize("answer, reference, expected", KIND_CASES)
def test_issue_kinds(answer, reference, expected):
    assert grade(answer, reference) is expected


def test_enough_cases_in_both_directions():
    assert len(CASES) >= 60
    assert sum(expected for *_, expected in CASES) >= 30 and sum(not e for *_, e in CASES) >= 30


@pytest.mark.parametrize(
    "text, expected",
    [
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
    ],
)
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


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(completions=["1"], references=[]), "completions and references"),
        (dict(completions=["1"], references=["1"], answer_format="xml"), "answer_format"),
        (dict(completions=["1"], references=["1"], workers=0), "workers"),
        (dict(completions=[None], references=["1"]), "completions\\[0\\]"),
    ],
)
def test_reward_rejects_bad_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        reward.reward(**kwargs)


def test_fast_path_needs_neither_sympy_nor_workers():
    code = (
        "import json, sys, reward; scores = reward.reward(['#### 42', '\\\\boxed{0.5}', '7,000', '#### 41', 'x = 5'], "
        "['42', '\\\\frac12', '7000', '42', '5']); print(json.dumps([scores, 'sympy' in sys.modules, "
        "len(reward._POOL.idle)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert json.loads(out) == [[1.0, 1.0, 1.0, 0.0, 1.0], False, 0]


def test_command_line_shows_verdict_and_both_forms():
    run = lambda *args: subprocess.run(
        [sys.executable, "reward.py", *args],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = run("The answer is $\\boxed{\\dfrac{1}{2}}$.", "0.5")
    assert out.returncode == 0 and out.stdout.splitlines() == [
        "verdict: correct",
        "prediction:",
        "  extracted:  '\\\\dfrac{1}{2}'",
        "  normalized: '\\\\frac{1}{2}'",
        "reference:",
        "  extracted:  '0.5'",
        "  normalized: '0.5'",
    ]
    assert run("#### 41", "42").stdout.startswith("verdict: wrong\n")
    assert run("--help").stdout.startswith("usage: python reward.py PRED GOLD") and run("1").returncode == 2


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


@pytest.mark.parametrize(
    "make_payload",
    [
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
        lambda path: "\\boxed{" + "x+" * 50_000 + "1}",
        lambda path: "$" * 50_000 + "\\(" * 20_000 + "#" * 30_000,
        lambda path: "\\boxed{\\sum_{i=1}^{999} \\sum_{j=1}^{999} i \\cdot j}",
        lambda path: "\\boxed{\\prod_{k=1}^{999} k^{999}}",
        lambda path: "\\boxed{\\sum_{k=1}^{999} k^{k^{k}}}",
        lambda path: " and ".join(f"\\boxed{{x^{{{i}}}}}" for i in range(2_000)),
        lambda path: "\\boxed{x \\approx " * 300 + "1" + "}" * 300,
        lambda path: "The final answer is " + "答案是 " * 20_000,
    ],
)
def test_hostile_output_is_wrong_fast_and_inert(make_payload, tmp_path):
    marker = tmp_path / "executed"
    start = time.monotonic()
    assert not grade(make_payload(marker), "3", timeout=1.0)
    assert time.monotonic() - start < 1.0 + 5
    assert not marker.exists()


def test_explosive_answers_equal_to_themselves_use_exact_text():
    assert grade("\\boxed{10^{10^{10}}}", "10^{10^{10}}") and grade("\\boxed{(10^8)!}", "(10^8)!")


# ----------------------------------------------------------------------------- math-verify's public suite

# Facts ported from huggingface/Math-Verify's tests (MIT licence): tests/test_all.py, tests/test_yujianll.py and
# tests/test_mixed_number_extraction.py, as (gold, prediction, expected) in math-verify's order. Left out: cases
# whose prediction is a model output of several thousand characters, cases that call math-verify's internals or
# other precisions than its default, and the commented-out ones. Two rows of test_set_rel_assymetry are ported
# with allow_set_relation_comp=True, the reading this checker takes.
MATH_VERIFY_CASES = [
    # test_all.py::test_number_extraction
    ("-5", "-5", True),
    ("7425000", "7,425,000", True),
    ("1000", "1 000", True),
    ("1000", "1000.0", True),
    ("1000.0", "1,000.0", True),
    ("1000.99", "1000,99", True),
    ("1,22", "1.22", True),
    ("2.74", "Soucis : 2,74 $ a..", True),
    ("0.4", ".4", True),
    ("1000.99", "1,000.99", True),
    ("1000.99", "$1,000.99", True),
    ("1000.99", "1,000.99$", True),
    ("1000.99", "the number is not 10 which is 1,000.99€", True),
    ("1000.99", "so the number is 10 which is 1,000.99m²", True),
    ("1000.99", "not it's not 10 it's 1,000.99m²", True),
    ("0,111", "0.111", True),
    ("2", "AZYUK2A", False),
    # test_all.py::test_simple_fraction_notation
    ("10/9", "\\frac{10}{9}", True),
    ("-10/9", "-\\frac{10}{9}", True),
    # test_all.py::test_sets_handling
    ("$[0,1)$", "$[0,1)$", True),
    ("$[0,9)$", "$[0,1)$", False),
    ("$(0,9)$", "$[0,9)$", False),
    ("$1$", "$-[0,1)$", False),
    # test_all.py::test_latex_notation
    ("$9$", "Answer \\[ 9 \\]", True),
    ("$9$", "Answer $ 9 $", True),
    ("$9$", "Answer $$ 9 $$", True),
    ("$9$", "Answer \\( 9 \\)", True),
    ("$10$", "Answer \\( (9+1) \\)", True),
    ("$9$", "Answer $ \n 9 \n $", False),
    ("$9$", "Answer \\( \n 9 \n \\)", False),
    ("$9$", "Answer \\[ \n 9 \n \\]", True),
    ("$9$", "Answer $$ \n 9 \n $$", True),
    ("$10/9$", "Answer $ \\frac{1}{2} \\$ = \\frac{10}{9} $", True),
    ("$1/3$", "$\\frac13 $", True),
    ("$1$", "$\\frac3{3} $", True),
    ("$\\sqrt{3}$", "$\\sqrt3 $", True),
    ("$1/3$", "$\\cfrac{1}{3} $", True),
    ("$1/3$", "$\\dfrac{1}{3} $", True),
    ("$1/3$", "$\\tfrac{1}{3} $", True),
    ("$1/3$", "$ 1/3 $", True),
    ("$1/3$", "$\\left( \\frac{1}{3} \\right)$", True),
    ("$1/3$", "$\\boxed{\\frac{1}{3}}$", True),
    ("$1/3$", "$\\frac{1}{3} \\text{meters}$", True),
    ("$1/3$", "$\\frac{1}{3} \\textbf{meters}$", True),
    ("$1/3$", "$k = \\frac{1}{3}$", True),
    # test_all.py::test_percent_notation
    ("$28\\%$", "28 percent", True),
    ("$28\\%$", "28 pct", True),
    ("$28\\%$", "28 %", True),
    ("$28\\%$", "$28$ %", True),
    ("$28\\%$", "$28$ percent", True),
    ("$28\\%$", "$\\boxed{28}$ pct", True),
    ("$28\\%$", "$\\boxed{28 pct}", True),
    ("$28\\%$", "$\\boxed{28 percent}", True),
    ("$28\\%$", "$\\boxed{28 percentage}", True),
    ("$28\\%$", "28", True),
    ("$0.28$", "28", False),
    ("$28/100$", "28", False),
    ("$28$", "28/100", False),
    ("$\\frac{28}{100}$", "28", False),
    ("$28*\\frac{1}{100}$", "28", False),
    # test_all.py::test_latex_notation_math (the shorter solutions)
    ("$2-2p$", "Since $x<2$, it follows that $|x-2|=2-x$. If $2-x=p$, then $x=2-p$. Thus $x-p=\\boxed{2-2p}$.", True),
    (
        "\\boxed{\n\\begin{pmatrix} 0 & 3 \\\\ 0 & -1 \\end{pmatrix}\n}.\n\\end{align*}",
        "\\boxed{\n\\begin{pmatrix} 0 & 3 \\\\ 0 & -1 \\end{pmatrix}\n}.\n\\end{align*}",
        True,
    ),
    (
        r"Since $25<30<36$, we have $5<\sqrt{30}<6$. We also know that $7^2=49$, so $\sqrt{50}\approx7$. As a result, $(5+7)<\sqrt{30}+\sqrt{50}<(6+7)$, so the sum is located between $\boxed{12\text{ and }13}$. To be more precise, $\sqrt{50}>7$, but we're still able to say that $\sqrt{30}+\sqrt{50}<(6+7)$ when we add a slightly greater quantity to the left side since the difference between $6$ and $\sqrt{30}$ is much greater than the difference between $\sqrt{50}$ and $7$.",
        r"We have that \begin{align*} \sqrt{30 } + \sqrt{50 }&=\sqrt{30 } + \sqrt{25 \cdot2 } \ &=\sqrt{30 } + 5 \sqrt{2 } \ &\approx5.477 + 5 \cdot1.414 \ &\approx5.477 + 7.07 \ &\approx12.547. \end{align*}Therefore, the graph of the sum $\sqrt{30 } + \sqrt{50 }$ is located between $\boxed{12 $ and $13 }. $ Final Answer: The final answer is \"$12 $ and $13 $\". I hope it is correct.",
        True,
    ),
    (
        "$\\frac{14}{3}$",
        r"$f(-2)+f(-1)+f(0)=\frac{3(-2)-2}{-2-2}+\frac{3(-1)-2}{-1-2}+\frac{3(0)-2}{0-2}=\frac{-8}{-4}+\frac{-5}{-3}+\frac{-2}{-2}=2+\frac{5}{3}+1=\boxed{\frac{14}{3}}$",
        True,
    ),
    (
        "$\\text{Evelyn}$",
        r"Evelyn covered more distance in less time than Briana, Debra and Angela, so her average speed is greater than any of their average speeds. Evelyn went almost as far as Carla in less than half the time that it took Carla, so Evelyn's average speed is also greater than Carla's. Therefore, $\boxed{\text{Evelyn}}$ is our answer.",
        True,
    ),
    (
        "$3\\sqrt{13}$",
        r"We use the distance formula:  \begin{align*} \sqrt{(2 - (-4))^2 + ((-6) - 3)^2} &= \sqrt{6^2 + (-9)^2}\\ & = \sqrt{36 + 81}\\ & = \sqrt{117} = \boxed{3\sqrt{13}}. \end{align*}",
        True,
    ),
    (
        "$2$",
        r"Of the two-digit perfect squares, only $4^2=16$ and $6^2=36$ end in $6$. Thus, there are $\boxed{2}$ distinct possible values for $B$.",
        True,
    ),
    (
        "$15\\mbox{ cm}^2$",
        r"The shaded triangle has a base of length $10\text{ cm}.$ Since the triangle is enclosed in a rectangle of height $3\text{ cm},$ then the height of the triangle is $3\text{ cm}.$ (We know that the enclosing shape is a rectangle, because any figure with four sides, including two pairs of equal opposite sides, and two right angles must be a rectangle.) Therefore, the area of the triangle is $$\frac{1}{2}\times 3 \times 10 = \boxed{15\mbox{ cm}^2}.$$",
        True,
    ),
    (
        "$-2,1$",
        r"By the Integer Root Theorem, the possible integer roots are all the divisors of 14 (including negative divisors), which are $-14,$ $-7,$ $-2,$ $-1,$ $1,$ $2,$ $7,$ and $14.$  Checking, we find that the only integer roots are $\boxed{-2,1}.$",
        True,
    ),
    (
        "$9$",
        r"We use the property that $a \equiv b \pmod{m}$ implies $a^c \equiv b^c \pmod{m}$. Since $129 \equiv -3 \pmod{11}$ and $96 \equiv -3 \pmod{11}$, we have  $$129^{34}+96^{38} \equiv (-3)^{34}+(-3)^{38} \equiv 3^{34}+3^{38} \pmod{11}.$$ Since $3^5 \equiv 1 \pmod{11},$ we can see that $3^{34} = (3^5)^{6} \cdot 3^4$ and $3^{38} = (3^5)^{7} \cdot 3^3.$ Then, $129^{34}+96^{38} \equiv \boxed{9} \pmod{11}.$",
        True,
    ),
    (
        "$90^\\circ$",
        "Therefore, \\begin{align*} \\angle BAC &= \\angle BAD + \\angle DAC \\\\ &= 50^\\circ+40^\\circ \\\\ &= \\boxed{90^\\circ}. \\end{align*}",
        True,
    ),
    (
        "$0$",
        "Note that $p(x)$ has degree at most 2.  Also, $p(a) = p(b) = p(c) = 1.$  Thus, the polynomials $p(x)$ and 1 agree at three different values, so by the Identity Theorem, they are the same polynomial.  Hence, the degree of $p(x)$ (which is the constant polynomial 1) is $\\boxed{0}.$",
        True,
    ),
    (
        "$(6,31,-1)$",
        "Let $\\alpha$ be a root of $x^3 - 3x^2 + 4x - 1 = 0,$ so $\\alpha^3 = 3 \\alpha^2 - 4 \\alpha + 1.$ Then solving the system of equations, we find $(p,q,r) = \\boxed{(6,31,-1)}.$",
        True,
    ),
    (
        "$1 \\pm \\sqrt{19}$",
        "This simplifies to $64y + 1920 = 0,$ so $y = -30.$ Then $x^2 - 2x - 48 = -30,$ or $x^2 - 2x - 18 = 0.$ By the quadratic formula, $x = \\boxed{1 \\pm \\sqrt{19}}.$",
        True,
    ),
    (
        "$3 \\pm 2 \\sqrt{2}$",
        "This gives us $x^2 + 1 = 6x,$ or $x^2 - 6x + 1 = 0.$ By the quadratic formula, the roots are $x = \\boxed{3 \\pm 2 \\sqrt{2}}.$",
        True,
    ),
    (
        "$\\{1\\pm\\sqrt{5},-2\\}$",
        "The roots of $P(x)$ are $-2$ and $1 \\pm \\sqrt{5}$, so the answer is $\\boxed{\\{1\\pm\\sqrt{5},-2\\}}.$",
        True,
    ),
    (
        "$2 \\sin b \\cos a$",
        "By sum-to-product,\n\\[\\sin (a + b) - \\sin (a - b) = \\boxed{2 \\sin b \\cos a}.\\]",
        True,
    ),
    ("$125$ miles", "The distance is $\\boxed{125\\textnormal{ miles}}.$", True),
    (
        "$[-1, -\\frac{1}{2}) \\cup (-\\frac{1}{2}, 0) \\cup (0, 1) \\cup (1, \\infty)$",
        "The solution set is $\\boxed{[-1, -\\tfrac12) \\cup (-\\tfrac12, 0) \\cup (0, 1) \\cup (1, \\infty)}.$",
        True,
    ),
    ("$\\sqrt{2}+\\sqrt{5}$", "The answer is $\\boxed{\\sqrt 2+\\sqrt 5}$", True),
    ("$\\frac{9}{4}\\pi$", "Therefore $\\boxed{\\frac94\\pi}$.", True),
    ("x \\in \\boxed{\\{-1\\} \\cup [0,7)}.$", "x \\in \\boxed{\\{-1\\} \\cup [0,7)}.$", True),
    # test_all.py::test_relations_math
    ("$x >= 5$", "Therefore $x \\geq 5$ is the solution.", True),
    ("$x < 3$", "We find that $x \\lt 3$.", True),
    ("$x \\leq 2$", "Thus $x <= 2$ is our answer.", True),
    ("$x > 5$", "Therefore $x \\gt 5$ is the solution.", True),
    ("$x != 3$", "We find that $x \\neq 3$.", True),
    ("$x > 5$", "Therefore $x < 5$ is the solution.", False),
    ("$x \\geq 5$", "The solution is $x \\leq 5$", False),
    ("$x \\neq 5$", "The solution is $x != 5$", True),
    ("$x \\leq 5$", "$5 \\geq x$", True),
    ("$x \\geq 5$", "$5 \\leq x$", True),
    ("$x = 11$", "$x = 5+5+1 = 7 =11$", True),
    ("$7 = 11a+c$", "$11a+c$", False),
    ("$x = 1/3$", "$x = 5+5+1 = 1/3 \\approx 11$", True),
    ("$11$", "$x=11$", True),
    ("$11$", "$x\\approx11$", True),
    ("$1/3$", "$x=1/3\\approx1.3$", True),
    ("$x < 1$", "$-x > -1$", True),
    ("$x < 1$", "$x > -1$", False),
    ("$x <= 1$", "$-x >= -1$", True),
    ("$a +3z = 0$", "$0$", False),
    ("$1 = \\zzz = x = 0$", "$0$", True),
    ("$2x + z = 1$", "$1$", False),
    ("$a^2 + b = 0$", "$0$", False),
    ("$k=1$", "$1$", True),
    ("$1$", "$k=1$", True),
    ("$z = 1 + 1 = 2$", "$z = 3+3 = 2$", True),
    ("$2x+4y-3=0$", "$y=-\\frac{1}{2}x+\\frac{3}{4}$", True),
    ("$x^2/4 + y^2/3 = 1$", "$x^2/16 + y^2/12 = 1/4$", True),
    # test_all.py::test_matrix_extraction
    (
        r"$\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}$",
        r"The identity matrix is $ \begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix} $.",
        True,
    ),
    (
        r"$\begin{bmatrix}0 & 0 \\0 & 0\end{bmatrix}$",
        r"Here is a zero matrix: $ \begin{pmatrix}0 & 0 \\0 & 0\end{pmatrix} $",
        True,
    ),
    (
        r"$\begin{pmatrix}1 & 2 \\3 & 4\end{pmatrix}$",
        r"Special matrix: $ \left[\begin{array}{cc}1 & 2 \\3 & 4\end{array}\right] $",
        True,
    ),
    (
        r"$\begin{pmatrix}\frac{1}{2} & \frac{3}{4} \\ \frac{5}{6} & \frac{7}{8}\end{pmatrix}$",
        r"Matrix with fractions: $ \begin{pmatrix}\frac{1}{2} & \frac{3}{4} \\ \frac{5}{6} & \frac{7}{8}\end{pmatrix} $",
        True,
    ),
    (
        r"$\begin{pmatrix}6 & 8 \\ 10 & 12\end{pmatrix}$",
        r"The sum is $\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix} + \begin{pmatrix}5 & 6 \\ 7 & 8\end{pmatrix}$",
        True,
    ),
    (
        r"$\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}$",
        r"When multiplying by identity: $\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix} \begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}$",
        True,
    ),
    (
        r"$\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}$",
        r"The matrix is $\begin{pmatrix}1 & 2 \\ 3 & 5\end{pmatrix}$",
        False,
    ),
    # test_all.py::test_precision and test_complex_math_expressions (at math-verify's default precision)
    ("$\\frac{1}{3}$", "0.3333$", True),
    ("$\\frac{1}{12}$", "$0.0833333333333333$", True),
    ("$(1,\\frac{9}{2})$", "$(1,4.5)$", True),
    ("$\\frac{x+2}{7}$", "$\\frac{x}{7}+\\frac{2}{7}$", True),
    ("$\\tan^2(y)+1$", "$\\sec^2(y)$", True),
    (
        "$\\begin{pmatrix}-\\\frac{7}{4}&-2\\\\\\\\4&\\\\frac{1}{4}\\\\\\\\\\\\end{pmatrix}$",
        "$\\begin{pmatrix}-\\\frac{7}{4}&-2\\\\\\\\4&\\\\frac{1}{4}\\\\\\\\\\\\end{pmatrix}$",
        True,
    ),
    (
        "$\\begin{pmatrix}\\frac{1}{3\\sqrt[3]{x}^2}&0&0\\\\0&1&0\\\\-\\sin(x)&0&0\\\\\\end{pmatrix}$",
        "$\\begin{pmatrix}\\frac{1}{3x^{2/3}}&0&0\\\\0&1&0\\\\-\\sin(x)&0&0\\end{pmatrix}$",
        True,
    ),
    ("$34x+45y-20z+100=0$", "$-34x-45y+20z-100=0$", True),
    (
        "$\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{15+2\\sqrt{33}}$",
        "$\\frac{\\sqrt{\\sqrt{11}+\\sqrt{194}}}{2\\sqrt{33}+15}$",
        True,
    ),
    ("$(a+5)(b+2)$", "$(+5)(b+2)$", False),
    ("$2$", "$\\frac{1+\\sqrt{5}}{2}$", False),
    ("$4$", "$\\frac{34}{16}+\\frac{\\sqrt{1358}}{16}$", False),
    ("$1\\sqrt{19}$", "$1$", False),
    ("$x+2n+1$", "$x+1$", False),
    (f"{math.sqrt(17):.15f}", "$\\sqrt{17}$", True),
    ("$4$", "$4\\sqrt{2}$", False),
    ("$\text{13}$", "$13$", False),
    # test_all.py::test_math_extraction_edge_cases and additional cases (the shorter ones)
    (
        "$2/3$",
        r"and then Alice wins the game from that point on. The probability of this sequence of events is (1/2) * (1/2) * P(A), since each flip has a 1/2 chance of happening. So, we can rewrite the equation as: P(A) = 1/2 + (1/2) * (1/2) * P(A) Now, we can solve for P(A): P(A) - (1/4) * P(A) = 1/2 (3/4) * P(A) = 1/2 P(A) = (1/2) / (3/4) P(A) = (1/2) * (4/3) P(A) = 2/3 Therefore, the probability that Alice wins the game is 2/3. <|im_start|>user",
        True,
    ),
    (
        "$[0,1)$",
        r"For the function $q(x)$ to be defined, both the numerator and the denominator must be real numbers, and the denominator must not be zero. 1. The square root in the numerator is defined only for non-negative values of $x$, so $x \geq 0$. 2. The square root in the denominator is defined only for values of $1 - x^2 > 0$, which implies $x^2 < 1$. This gives $-1 < x < 1$. 3. The denominator cannot be zero, so $1 - x^2 \neq 0$, which implies $x \neq \pm 1$. Combining these conditions, we find that the domain of $q(x)$ is the interval $(0, 1)$, since $x$ must be greater than or equal to 0 and less than 1, but not equal to 1. Final Answer: The final answer is $(0, 1)$. I hope it is correct. <|im_start|>user",
        False,
    ),
    (
        "12000023",
        r"To find the integers congruent to 3 (mod 7), we can find the remainder when each integer is divided by 7. For 85, the remainder is $85 \mod 7 = 1$. For 49,479, the remainder is $49,\!479 \mod 7 = 3$. For -67, the remainder is $-67 \mod 7 = 4$. For 12,000,003, the remainder is $12,\!000,\!003 \mod 7 = 5$. For -3, the remainder is $-3 \mod 7 = 4$. The only integer congruent to 3 (mod 7) is 49,479. Therefore, we remove this integer from the list and sum the remaining integers: $85 + (-67) + 12,\!000,\!003 + (-3) = 12,\!000,\!023$. Final Answer: The final answer is 12,000,023. I hope it is correct. <|im_start|>user",
        True,
    ),
    (
        r"$\\left(\\frac{4}{5},\\frac{1}{5}\\right)$",
        r"Since $AP:PB = 1:4,$ we can write \[\frac{\overrightarrow{P} - \overrightarrow{A}}{1} = \frac{\overrightarrow{B} - \overrightarrow{P}}{4}.\]Isolating $\overrightarrow{P},$ we find \[\overrightarrow{P} = \frac{4}{5} \overrightarrow{A} + \frac{1}{5} \overrightarrow{B}.\]Thus, $(t,u) = \boxed{\left( \frac{4}{5}, \frac{1}{5} \right)}.$ Final Answer: The final answer is $\left( \frac{4}{5}, \frac{1}{5} \right)$. I hope it is correct. <|im_start|>user",
        True,
    ),
    (
        "$16386.17$",
        r"Rounded to the nearest cent, Paula's investment is worth $\boxed{\$16386.17}$ after 5 years. I hope it is correct. <|im_start|>user",
        True,
    ),
    (
        "$less than or equal to zero between its roots. Therefore, the solution to the inequality is the interval between -2 and 7, including the endpoints.\n\nThus, the solution in interval notation is:\n\n\\[ \\boxed{[-2, 7]} \\]$",
        "$x \\in [-2,7]$",
        True,
    ),
    (
        r"$19$",
        r"So, the total number of points in the domain is $1 + 2 \times 9 = 1 + 18 = 19$ points. Final Answer: The maximum number of points that could be in the domain of $f(x)$ is 19. <|im_start|>user",
        True,
    ),
    ("$34$", r"Final Answer: The largest $n$ is 34.", True),
    (
        r"$\\left( \\frac{4}{3}, -\\frac{1}{3} \\right)$",
        r"Isolating $\overrightarrow{P},$ we find \[\overrightarrow{P} = \frac{4}{3} \overrightarrow{A} - \frac{1}{3} \overrightarrow{B}.\]Thus, $(t,u) = \boxed{\left( \frac{4}{3}, -\frac{1}{3} \right)}.$",
        True,
    ),
    (r"$(3,1)$", r"${1,3}$", False),
    (r"$(1,3)$", r"${1,3}$", True),
    (
        "$14400$",
        r"Within each block, the members can be arranged in $5!$ ways. So, the total number of distinguishable ways is $1 \times 5! \times 5! = 120 \times 120 = \boxed{14400}$. Final Answer: The final answer is 14400. I hope it is correct.",
        True,
    ),
    (
        "$100$",
        r"Thus, the new error in the measurement of the position is at least $100\%$ of the original error in the measurement of the position. Final Answer: The final answer is $100$. I hope it is correct.",
        True,
    ),
    (
        "$x-2y+z-1=0$",
        r"The equation of the plane containing $L$ and the point $(1,1,1)$ is then $$-1(x-1)+2(y-1)+1(z-1)=0\Rightarrow\boxed{x-2y+z-1=0}.$$ Final Answer: The final answer is $x-2y+z-1=0$. I hope it is correct.",
        True,
    ),
    (
        "$10455$",
        r"$0.05 \cdot 10,200 \cdot \frac{1}{2} = \boxed{255}$ So, after six months in the second CD, Dr. Zaius has $10,200 + $255 = $10,455. Final Answer: The final answer is $10,455$. I hope it is correct.",
        True,
    ),
    (
        r"$[-4,0]$",
        r"Thus, the values of \( k \) for which the quadratic has real roots are: \[ \boxed{[-4, 0]} \]",
        True,
    ),
    (
        r"Substituting $x = 3$, we get $12 = -2A$, so $A = -6$. Substituting $x = 5$, we get $20 = 2B$, so $B = 10$. Therefore, $(A, B) = \boxed{(-6, 10)}.$",
        r"The solution to the inequality is \( x \in (-6, 10) \). Final Answer: The final answer is \((-6, 10)\). I hope it is correct.",
        True,
    ),
    (r"\(\boxed{\text{C}}\).", r"$\boxed{\text{(C)}}.$", True),
    (r" So the answer is: \[ \boxed{11111111100} \]", r"is $\boxed{11,\! 111,\! 111,\! 100}$", True),
    (r" So the answer is: \[ \boxed{32349} \]", r"is $\boxed{32,\! 349}$", True),
    (r" So the answer is: \[ \boxed{32349} \]", r"is $\boxed{32, 349}$", False),
    (
        r"Thus, the domain of the function \( f(x) \) is: \[ \boxed{(2, 12) \cup (12, 102)} \]",
        r"Thus, the answer is $x \in \boxed{(2,12) \cup (12,102)}$",
        True,
    ),
    (r"$\text{E}$", r"$E$", True),
    (r"$\boxed{1}\boxed{2}$", r"$\boxed{1,2}$", True),
    (
        r"so \[f(n) = \frac{n^2 + 3n - 2}{2}\]for all positive integers $n.$ This factors as $(n - 1)(n + 2) = 0,$ so the solutions are $n = \boxed{1,-2}.$",
        r"Solving this quadratic equation, we find the roots: \[ n = 1 \quad \text{and} \quad n = -2. \] Thus, the integers \( n \) such that \( f(n) = n \) are: \[ \boxed{-2} \quad \text{and} \quad \boxed{1}. \]",
        True,
    ),
    # test_all.py::test_set_rel_assymetry (with allow_set_relation_comp=True)
    (r"$-2 \le x \le 7$", r"$x \in [-2,7]$", True),
    (r"$x \in [-2,7]$", r"$-2 \le x \le 7$", True),
    # test_all.py::test_trailing_punctuation
    (r"$\frac{1}{3}$", r"$\frac{1}{3}.$", True),
    (r"$\frac{1}{3}$", r"The answer is $\frac{1}{3}.$", True),
    (r"$\frac{1}{3}$", r"$$\frac{1}{3}.$$", True),
    (r"$\frac{1}{3}$", r"\[\frac{1}{3}.\]", True),
    (r"$\frac{1}{3}$", r"$\frac{1}{3},$", True),
    (r"$\frac{1}{3}$", r"$\frac{1}{3} .$", True),
    (r"$\sqrt{2}$", r"$\sqrt{2}.$", True),
    (r"$(1,2)$", r"$(1,2).$", True),
    (r"$5$", r"$5 \text{ cm}.$", True),
    (r"$42$", r"$42.$", True),
    (r"$2$", r"$2^{10}.$", False),
    (r"$1$", r"The answer is $1/3.$", False),
    (r"$1, 2, 3$", r"$1, 2, 3, ...$", False),
    # test_yujianll.py
    ("$n=1, 2, 3$", "$n=1, 2, 3$", True),
    ("$n=2, 3, 4$", "$n=1, 2, 3$", False),
    ("$D = (0, 1)$", "$D = (0, 1)$", True),
    ("$D = (0, 1)$", "$D = (0, 1.5)$", False),
    ("$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$", "$F_n = \\sum_{k=0}^{n-2} F_k F_{n-k-2}$", False),
    ("$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$", "$F_n = \\sum_{k=0}^{n-1} F_{n-k-1} F_k$", True),
    ("$19, 46, and 82$", "$19, 46, \\text{ and } 82$", True),
    ("$19, 46, and 82$", "$21, 36, and 82$", False),
    ("$1 - \\frac{1}{\\mathrm{e}}$", "$1 - \\frac{1}{\\mathrm{e}}$", True),
    ("$1 - \\frac{1}{\\mathrm{e}}$", "$1 + \\frac{1}{\\mathrm{e}}$", False),
    ("$\\pm 2021$", "$2021$", False),
    ("$\\pm 2021$", "${-2021, 2021}$", True),
    ("$12:00$", "$1:00$", False),
    ("$12:00$", "$12:00$", True),
    # test_mixed_number_extraction.py
    ("40/9", "The answer is 4 4/9.", True),
    ("4", "The answer is 4 4/9.", False),
    ("71/6", "11 5/6", True),
    ("71/6", "+11 5/6", True),
    ("4/9", "0 4/9", True),
    ("139/90", "11/10 4/9", False),
    ("103/9", "11.0 4/9", False),
    ("71/6", "11\n5/6", False),
    ("103/9", "11 - 4/9", False),
]

# Where this checker still answers differently, and why (a strict xfail: fixing one turns it into a failure to update).
MATH_VERIFY_DIFFERENCES = {
    ("2.74", "Soucis : 2,74 $ a.."): "a prose label before the number and text after it in a bare answer",
    (
        r"$\begin{pmatrix}6 & 8 \\ 10 & 12\end{pmatrix}$",
        r"The sum is $\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix} + \begin{pmatrix}5 & 6 \\ 7 & 8\end{pmatrix}$",
    ): "matrix arithmetic is not evaluated",
    (
        r"$\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}$",
        r"When multiplying by identity: $\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix} "
        r"\begin{pmatrix}1 & 0 \\ 0 & 1\end{pmatrix}$",
    ): "matrix arithmetic is not evaluated",
    (
        "$F_n = \\sum_{k=0}^{n-1} F_k F_{n-k-1}$",
        "$F_n = \\sum_{k=0}^{n-1} F_{n-k-1} F_k$",
    ): "sums with symbolic bounds and expression subscripts are compared as text only",
}


@pytest.mark.parametrize(
    "gold, prediction, expected",
    [
        pytest.param(*case, marks=pytest.mark.xfail(reason=MATH_VERIFY_DIFFERENCES[case[:2]], strict=True))
        if case[:2] in MATH_VERIFY_DIFFERENCES
        else case
        for case in MATH_VERIFY_CASES
    ],
)
def test_math_verify_suite(gold, prediction, expected):
    assert grade(prediction, gold) is expected


def test_math_verify_suite_size():
    assert len(MATH_VERIFY_CASES) >= 190 and len(MATH_VERIFY_DIFFERENCES) <= 0.03 * len(MATH_VERIFY_CASES)


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


# ----------------------------------------------------------------------------- answers that restate the problem

# (completion, reference, problem, template, expected)
ECHO_CASES = [
    ("7 + 6", "13", "What is 7 + 6?", None, False),  # the question restated is no answer
    ("7 + 6", "13", None, None, True),  # ... though it equals 13, which is all a checker without the question sees
    ("15 - 7", "8", "What is 15 - 7?", None, False),
    ("6 + 7", "13", "What is 7 + 6?", None, False),  # commuted: still only the question's numbers
    ("7 + 6 + 0", "13", "What is 7 + 6?", None, False),  # 0 and 1 change nothing
    ("7 × 6 × 1", "42", "What is 7 × 6?", None, False),
    ("1 + 1", "2", "What is 1 + 1?", None, False),  # a truncated "1 + 1 = 2"
    ("x = 7 + 6", "13", "What is 7 + 6?", None, False),
    ("13 = 7 + 6", "13", "What is 7 + 6?", "equation", False),
    ("\\boxed{2^{10}}", "1024", "Compute $2^{10}$.", None, False),
    ("\\boxed{12/4}", "3", "What is 12 divided by 4?", None, False),  # a division still to carry out
    ("\\boxed{5!}", "120", "How many orders of 5 books are there?", None, False),
    ("7 + 6 = 13", "13", "What is 7 + 6?", "equation", True),  # the equation template's answer: after the last "="
    ("7 + 6 = 12 + 1 = 13", "13", "What is 7 + 6?", "equation", True),
    ("5 x 4 = 20", "20", "What is 5 × 4?", "equation", True),  # a letter x on the left is no longer in the way
    ("7 + 6 = 14", "13", "What is 7 + 6?", "equation", False),
    ("7 + 6 =", "13", "What is 7 + 6?", "equation", False),  # nothing after the "="
    ("13", "13", "What is 7 + 6?", "equation", True),
    ("10 + 3", "13", "What is 7 + 6?", None, True),  # an expression over other numbers is work shown, not an echo
    ("\\boxed{3/4}", "0.75", "What is 3 divided by 4?", None, True),  # a fraction in lowest terms is a value
    ("\\boxed{2^{10}}", "2^{10}", "Compute $2^{10}$.", None, True),  # written so by the reference too
    ("\\boxed{-5}", "-5", "What is 2 - 7?", None, True),  # a sign is no operation
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", "Find sin 60, given 3 and 2.", None, True),
    ("The answer is 1,234 + 1", "1235", "Add 1,234 and 1.", None, False),  # thousands separators are one number
]


@pytest.mark.parametrize("completion, reference, problem, template, expected", ECHO_CASES)
def test_an_answer_that_restates_the_problem_is_wrong(completion, reference, problem, template, expected):
    assert grade(completion, reference, problem=problem, template=template) is expected


def test_the_equation_template_grades_what_follows_the_last_equals_sign():
    assert reward.answer_of("7 + 6 = 13", "equation") == "13" and reward.answer_of("7 + 6 = 13") == "7 + 6 = 13"
    assert reward.reward(["7 + 6", "13"], ["13", "13"], problems=["What is 7 + 6?"] * 2, template="equation") == [0, 1]
    with pytest.raises(ValueError, match="completions and problems differ in length"):
        reward.reward(["1"], ["1"], problems=[])


def test_the_command_line_grades_in_the_problems_context():
    run = lambda *args: subprocess.run(
        [sys.executable, "reward.py", *args],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = run("7 + 6", "13", "--problem", "What is 7 + 6?", "--template", "equation")
    assert out.returncode == 0 and out.stdout.splitlines()[0] == "verdict: wrong"
    assert out.stdout.splitlines()[-1].startswith("restates the problem")
    assert run("7 + 6 = 13", "13", "--problem", "What is 7 + 6?", "--template", "equation").stdout.splitlines()[:4] == [
        "verdict: correct",
        "prediction:",
        "  extracted:  '7 + 6 = 13'",
        "  normalized: '13'",
    ]
    assert run("7 + 6", "13").stdout.startswith("verdict: correct\n")  # without the problem nothing says it is one
    bad = run("1", "2", "--prob", "x")
    assert bad.returncode == 2 and bad.stderr == "reward.py: unrecognized arguments: --prob x (see --help)\n"


# ----------------------------------------------------------------------------- numbers of any length, hostile text


@pytest.mark.parametrize("digits", [4_200, 4_299, 4_301, 5_000, 40_000])
def test_huge_integers_compare_exactly_and_never_raise(digits):
    n = "7" * digits
    for completion in (n, f"\\boxed{{{n}}}", f"The answer is {n}.", "so " * 2_000 + n, f"-{n}"):
        sign = "-" if completion.startswith("-") else ""
        assert grade(completion, sign + n), completion[:20]
        assert not grade(completion, sign + n[:-1] + "8"), completion[:20]
    assert grade(f"{n}.50", f"{n}.5") and grade(f"{n}/3", f"{n}/3")
    assert not grade(n, n + "7")


def hostile_texts(seed: int = 0, count: int = 300) -> list[str]:
    """Random concatenations of the pieces answers are parsed from: brackets, commands, numbers of every size."""
    pieces = [
        "\\boxed{",
        "}",
        "{",
        "(",
        ")",
        "[",
        "]",
        "\\frac",
        "\\sqrt",
        "^",
        "_",
        "=",
        "<",
        "\\le",
        ",",
        ";",
        "\\pm",
        "$",
        "$$",
        "\\(",
        "\\)",
        "#### ",
        "Answer:",
        "The final answer is ",
        "x",
        " ",
        "\n",
        "-",
        "+",
        "/",
        "!",
        ".",
        "\\text{and}",
        "\\begin{pmatrix}",
        "\\end{pmatrix}",
        "&",
        "\\\\",
        "e",
        "i",
        "\\infty",
        "1",
        "0",
        "9" * 50,
        "7" * 4_400,
        "3" * 31_000,
        "1e9999",
        "0." + "3" * 5_000,
        "\\ud800",
        "\x00",
        "答案是",
    ]
    rng = random.Random(seed)
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(count)]


def test_no_string_makes_the_checker_raise():
    """Extraction, normalization and the exact comparisons run in this process: none may raise (the guard in
    reward() would turn it into a warning). A few dozen pairs also reach the sympy workers."""
    texts = hostile_texts()
    for text, reference, problem in zip(texts, texts[::-1], texts[1:] + texts[:1]):
        reward._grade_fast(text, reference, problem, "equation")
        reward.answer_of(text, "equation")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = reward.reward(texts[:40], texts[:40][::-1], problems=texts[1:41], template="equation", timeout=1.0)
    assert set(scores) <= {0.0, 1.0}


def test_the_benchmark_finds_its_data_or_fails_saying_where_it_looked(tmp_path):
    bench = Path(reward.__file__).parent / "bench" / "reward.py"
    missing = subprocess.run([sys.executable, str(bench), "--data", str(tmp_path)], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stdout == "", "a benchmark that did not run does not pass"
    assert missing.stderr.strip() == (
        f"bench/reward.py: no GSM8K and MATH-500 answers in {tmp_path} (gsm8k.jsonl "
        "or gsm8k_test.jsonl, and math500.jsonl); run `python data/prepare.py gsm8k "
        "math500` or give --data DIR"
    )
    # prepared files, as data/prepare.py writes them (no GSM8K solutions: that row is left out)
    (tmp_path / "gsm8k.jsonl").write_text(
        "".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) + "\n" for i in range(4))
    )
    (tmp_path / "math500.jsonl").write_text(
        "".join(json.dumps({"problem": f"q{i}", "answer": f"\\frac{{{i}}}{{7}}"}) + "\n" for i in range(1, 4))
    )
    ran = subprocess.run(
        [sys.executable, str(bench), "--data", str(tmp_path), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert "GSM8K answers vs themselves" in ran.stdout and "MATH-500 boxed vs shuffled" in ran.stdout
    assert "GSM8K solutions" not in ran.stdout and f"data: {tmp_path / 'gsm8k.jsonl'}" in ran.stdout


def test_split_thinking_keeps_only_what_follows_the_last_closing_tag():
    from data.templates import Thought, split_thinking

    assert split_thinking("Answer: 12") == Thought("", "Answer: 12")  # no thought: all of it is the answer
    assert split_thinking("<think>a</think>b</think>c") == Thought("a</think>b", "c")  # the last tag counts
    assert split_thinking("<think>\nstill going") == Thought("\nstill going", None)  # never closes
    assert split_thinking("still going", open_at_start=True) == Thought("still going", None)
    assert split_thinking("done</think> 5", open_at_start=True) == Thought("done", " 5")
    assert split_thinking("x <think> y") == Thought(" y", None)  # a thought opened late and left open
