"""Tests for data/: the arithmetic and code generators, prompt templates and solutions, stop tokens, thinking mode.
Dataset files and their conversion: test_prepare.py."""

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import DAPO_WRAPPER
from data import arithmetic_problems, load_problems, render_prompt, stop_ids, user_message
from data.arithmetic import DEFAULT_KINDS, KINDS, problems_of

# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_deterministic_and_seeded():
    first = arithmetic_problems("train", n=60, seed=3)
    assert first == arithmetic_problems("train", n=60, seed=3)
    assert first != arithmetic_problems("train", n=60, seed=4)


def test_arithmetic_answers_are_right():
    compute = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b}
    for split in ("train", "test"):
        for p in arithmetic_problems(split, kinds=tuple(KINDS)):
            a, op, b = re.fullmatch(r"What is (\d+) (\S) (\d+)\?", p["problem"]).groups()
            assert p["answer"] == str(compute[op](int(a), int(b))), p


def test_arithmetic_splits_are_disjoint_and_cover_every_problem():
    sizes = {"add1": 100, "sub1": 100, "times": 81, "add2": 8100}
    for kind, size in sizes.items():
        train = {p["problem"] for p in problems_of(kind, "train")}
        test = {p["problem"] for p in problems_of(kind, "test")}
        assert not train & test
        assert len(train) + len(test) == size
        assert 0.1 * size < len(test) < 0.35 * size  # about TEST_PERCENT, as hashes fall
    # a sum's mirror image is on the same side of the split
    test_sums = {p["problem"] for p in problems_of("add1", "test")}
    for problem in test_sums:
        a, b = re.findall(r"\d+", problem)
        assert f"What is {b} + {a}?" in test_sums


def test_held_out_set_does_not_depend_on_seed_kinds_or_n():
    everything = arithmetic_problems("test", kinds=tuple(KINDS), seed=0)
    reseeded = arithmetic_problems("test", kinds=tuple(KINDS), seed=123)
    assert sorted(map(str, everything)) == sorted(map(str, reseeded))
    only_add1 = {p["problem"] for p in arithmetic_problems("test", kinds=("add1",), seed=7)}
    assert only_add1 == {p["problem"] for p in everything if p["kind"] == "add1"}
    # a kind's order does not depend on which other kinds are asked for
    mixed = arithmetic_problems("train", kinds=("add1", "times"), n=100, seed=5)
    alone = arithmetic_problems("train", kinds=("add1",), n=50, seed=5)
    assert [p for p in mixed if p["kind"] == "add1"] == alone


def test_arithmetic_balances_kinds_and_cycles_only_the_train_split():
    counts = Counter(p["kind"] for p in arithmetic_problems("train", n=300, seed=0))
    assert counts == {kind: 100 for kind in DEFAULT_KINDS}
    add1 = arithmetic_problems("train", kinds=("add1",), n=3 * 77 + 5)
    repeats = Counter(p["problem"] for p in add1)
    assert len(repeats) == 77 and set(repeats.values()) == {3, 4}  # whole passes before any repeat
    n_test = len(arithmetic_problems("test", kinds=("add1",)))
    assert len({p["problem"] for p in arithmetic_problems("test", kinds=("add1",), n=n_test)}) == n_test
    with pytest.raises(ValueError, match="n must be in 1..23"):
        arithmetic_problems("test", kinds=("add1",), n=24)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"split": "valid"}, "split must be"),
        ({"kinds": ("add1", "cube")}, r"unknown kinds \['cube'\]"),
        ({"kinds": "add1"}, "non-empty sequence"),
        ({"n": 0}, "n must be"),
    ],
)
def test_arithmetic_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        arithmetic_problems(**kwargs)


# ---------------------------------------------------------------- templates

DEFAULT_SYSTEM = "You are a helpful AI named SmolLM"
CHAT_TEMPLATE = (  # SmolLM2's shape: ChatML with a default system turn when none is given
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
    + DEFAULT_SYSTEM
    + "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer built here, offline, whose tokens can be predicted with a regex."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from data.templates import TEMPLATES

    text = " ".join(
        [
            *TEMPLATES.values(),
            DEFAULT_SYSTEM,
            "system user assistant Be brief. What is 7 + 5?",
            "Find $\\frac{a}{b}$ if {x} = 2.",
        ]
    )
    words = sorted(set(re.findall(r"\w+|[^\w\s]+", text)))
    vocab = {token: i for i, token in enumerate(SPECIALS + ["[UNK]", "<s>"] + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    # encode() prepends a BOS, as Llama-style tokenizers do: the chat path must not add it on top of the template
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="[UNK]",
        bos_token="<s>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIALS,
        chat_template=CHAT_TEMPLATE,
    )


def tokens(tokenizer, ids: list[int]) -> list[str]:
    return tokenizer.convert_ids_to_tokens(ids)


def expected_tokens(text: str) -> list[str]:
    """The tiny tokenizer's split, predicted: special tokens first, then words and punctuation runs."""
    pieces = re.split(r"(<\|im_start\|>|<\|im_end\|>)", text)
    return [t for piece in pieces for t in ([piece] if piece in SPECIALS else re.findall(r"\w+|[^\w\s]+", piece))]


def test_render_prompt_goes_through_the_chat_template(tokenizer):
    ids = render_prompt(tokenizer, "What is 7 + 5?", "plain")
    expected = (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n"
        "What is 7 + 5? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokens(tokenizer, ids) == expected_tokens(expected)
    assert all(isinstance(i, int) for i in ids)


def test_short_system_prompt_replaces_the_default(tokenizer):
    default = render_prompt(tokenizer, "What is 7 + 5?", "plain")
    short = render_prompt(tokenizer, "What is 7 + 5?", "plain", system="Be brief.")
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "What is 7 + 5? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokens(tokenizer, short) == expected_tokens(expected)
    assert len(short) < len(default) and "SmolLM" not in tokens(tokenizer, short)


def test_answer_and_boxed_templates(tokenizer):
    problem = "Find $\\frac{a}{b}$ if {x} = 2."
    assert user_message(problem, "boxed") == (
        problem + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    assert user_message(problem, "answer") == DAPO_WRAPPER.format(problem)
    for template in ("answer", "boxed"):
        ids = render_prompt(tokenizer, problem, template, system="Be brief.")
        assert "[UNK]" not in tokens(tokenizer, ids)
        assert tokens(tokenizer, ids)[-2:] == ["<|im_start|>", "assistant"]  # the reply starts next
    assert user_message("What is 7 + 5?", "Q: {problem}\nA:") == "Q: What is 7 + 5?\nA:"
    with pytest.raises(ValueError, match="template must be one of answer, boxed, plain"):
        render_prompt(tokenizer, problem, "answer-format")


def test_tokenizer_without_chat_template_gets_plain_text(tokenizer):
    tokenizer_copy = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]", bos_token="<s>")
    assert tokenizer_copy.chat_template is None
    ids = render_prompt(tokenizer_copy, "What is 7 + 5?", "plain", system="Be brief.")
    text = "Be brief.\n\nWhat is 7 + 5? Answer with the number only."
    assert tokens(tokenizer_copy, ids) == ["<s>"] + expected_tokens(text)  # a base model gets its usual BOS


def test_stop_ids_join_the_checkpoint_end_tokens_and_the_tokenizer_eos(tokenizer):
    from model import ModelConfig

    eos = tokenizer.eos_token_id
    assert stop_ids(ModelConfig(eos_token_id=[9, eos, 2]), tokenizer) == sorted({2, 9, eos})
    assert stop_ids(ModelConfig(eos_token_id=9), tokenizer) == sorted({9, eos})
    assert stop_ids(ModelConfig(eos_token_id=None), tokenizer) == [eos]
    no_eos = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]")
    assert stop_ids(ModelConfig(eos_token_id=5), no_eos) == [5]
    with pytest.raises(ValueError, match="neither the model config nor the tokenizer names an EOS"):
        stop_ids(ModelConfig(eos_token_id=None), no_eos)


def test_render_solution_ends_in_the_templates_answer_format():
    import reward
    from data import render_solution

    thought = "<think>\n2 + 3 is 5.\n</think>\n\nAdding, $2+3=\\boxed{5}$."
    assert render_solution(thought, "5", "answer") == "Adding, $2+3=\\boxed{5}$.\nAnswer: 5"
    assert render_solution(thought, "5", "answer", thinking=True) == (
        "<think>\n2 + 3 is 5.\n</think>\n\nAdding, $2+3=\\boxed{5}$.\nAnswer: 5"
    )
    assert render_solution(thought, "5", "boxed") == "Adding, $2+3=\\boxed{5}$."  # has its box already
    assert render_solution("3 * 6 = 18 apples.", "18", "boxed") == (
        "3 * 6 = 18 apples.\nThe final answer is $\\boxed{18}$."
    )
    assert render_solution("7 + 5 = 12", "12", "equation") == "7 + 5 = 12"
    assert render_solution("7 + 5 = 12", "12", "plain") == "12"
    for template in ("answer", "boxed", "equation", "plain"):  # what SFT teaches is what the reward reads
        target = render_solution(thought if template != "equation" else "2 + 3 = 5", "5", template)
        assert reward.reward([target], ["5"]) == [1.0]
        if template in reward.ANSWER_FORMATS:
            assert reward.has_format(target, template)
    problem = arithmetic_problems("train", n=1)[0]
    assert reward.grade(problem["solution"], problem["answer"])


def test_code_problems_are_generated_split_and_gradable():
    train, test = load_problems("code"), load_problems("code_test")
    assert len(train) > 100 and len(test) > 20 and not {p["problem"] for p in train} & {p["problem"] for p in test}
    assert load_problems("code_test") == test  # the same problems, tests included, every time
    assert all(p["task"] == "code" and len(p["tests"]) == 5 for p in train + test)
    from data.programs import code_problems

    assert code_problems("train", n=300, seed=1)[:10] == code_problems("train", n=300, seed=1)[:10]
    with pytest.raises(ValueError, match="n must be in"):
        code_problems("test", n=1000)


def test_code_template_poses_its_example_in_code(tokenizer):
    text = tokenizer.decode(render_prompt(tokenizer, "Read an integer n and print n + 1.", "code", system="S"))
    assert text.count("python code block") == 2  # the worked example is posed the way the problem is
    assert text.count("<|im_start|> assistant") == 2 and text.rstrip().endswith("assistant")


def test_the_templates_module_runs_as_a_script():
    run = lambda *args: subprocess.run(
        [sys.executable, "data/templates.py", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=60,
    )
    assert run("--help").returncode == 0 and run("--help").stdout.startswith("usage: data/templates.py")
    assert run("--template", "equation", "What is 7 + 6?").stdout.splitlines() == [
        "user: What is 2 + 3?",
        "assistant: 2 + 3 = 5",
        "user: What is 7 + 6?",
    ]
    bad = run("--template", "nope")
    assert (
        bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("data/templates.py: --template")
    )


# ---------------------------------------------------------------- thinking mode


def test_qwen3_thinking_switch_and_an_unclosed_thought_earns_nothing():
    """Qwen3's template (its logic, built in conftest) thinks unless enable_thinking=False writes an empty
    thought into the prompt; the reward grades only what follows the last </think>."""
    import reward
    from conftest import CHAT_TEMPLATE, OPEN_THOUGHT_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE, make_tokenizer
    from data import opens_thought, takes_thinking, thinking_note

    qwen3 = make_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE, think_tokens=True)
    off = qwen3.decode(render_prompt(qwen3, "What is 7 + 5?", "plain", "Be brief.", thinking=False))
    on = qwen3.decode(render_prompt(qwen3, "What is 7 + 5?", "plain", "Be brief.", thinking=True))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and on.endswith("<|im_start|>assistant\n")
    assert off.startswith(on[: -len("<|im_start|>assistant\n")])
    assert takes_thinking(qwen3) and thinking_note(qwen3, True) is None and thinking_note(qwen3, False) is None
    assert not opens_thought(qwen3, True) and not opens_thought(qwen3, False)  # the model writes <think> itself

    plain = make_tokenizer(chat_template=CHAT_TEMPLATE)
    assert not takes_thinking(plain) and thinking_note(plain, False) is None
    assert "does not read enable_thinking" in thinking_note(plain, True) and "\n" not in thinking_note(plain, True)
    opener = make_tokenizer(chat_template=OPEN_THOUGHT_CHAT_TEMPLATE)
    assert opens_thought(opener) and "cannot be switched off" in thinking_note(opener, False)

    # completions as the sampler decodes them: <think> and </think> are kept, the end-of-turn token is not
    def completion(text: str) -> str:
        return qwen3.decode(qwen3.encode(text + "<|im_end|>", add_special_tokens=False), skip_special_tokens=True)

    truncated = completion("<think>\n7 + 5 is 12, so Answer: 12")  # hit the cap while thinking
    closed = completion("<think>\n7 + 5 is 12\n</think>\n\nAnswer: 12")
    revised = completion("<think>\nAnswer: 12 ... no\n</think>\n\nAnswer: 13")
    assert reward.reward([truncated, closed, revised], ["12"] * 3) == [0.0, 1.0, 0.0]
    assert reward.reward([truncated], ["12"], format_weight=0.5, answer_format="answer") == [0.0]
    # a template that opens the thought: a completion without </think> is all thought, even with no tag
    assert reward.reward(["7 + 5 is 12, so Answer: 12"], ["12"], open_thought=True) == [0.0]
    assert reward.reward(["7 + 5 is 12\n</think>\nAnswer: 12"], ["12"], open_thought=True) == [1.0]
