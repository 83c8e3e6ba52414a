"""Shared test fixtures: tiny random checkpoints in Hugging Face format, built offline.

Every test that needs a model builds one here with transformers' own classes and
`save_pretrained`, so our loader is always exercised on the real on-disk format.
"""

import atexit
import contextlib
import fcntl
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent
SHARED_DATA = ROOT.parent / "shared" / "data"

# Experiment trackers under test write into one temporary folder, never to the network or a user's home:
# W&B offline, and trackio's local database (whose folder trackio reads once, when it is imported).
TRACKERS = Path(tempfile.mkdtemp(prefix="grpo-test-trackers-"))
atexit.register(shutil.rmtree, TRACKERS, True)
os.environ.update(
    WANDB_MODE="offline",
    WANDB_SILENT="true",
    WANDB_DIR=str(TRACKERS / "wandb"),
    WANDB_CONFIG_DIR=str(TRACKERS / "wandb-config"),
    WANDB_CACHE_DIR=str(TRACKERS / "wandb-cache"),
    WANDB_DATA_DIR=str(TRACKERS / "wandb-data"),
    TRACKIO_DIR=str(TRACKERS / "trackio"),
)

# DAPO-Math-17k's wrapper around each problem: the Hub copy's prompts carry it, and the answer template asks for
# the same final line (test_prepare converts the one, test_data renders the other).
DAPO_WRAPPER = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's logic, written here (the real template is not offline): a system turn first, then the turns; the
# generation prompt opens the assistant turn, and with enable_thinking false it writes an empty thought.
QWEN3_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's distilled models: the generation prompt itself opens the thought, and no switch exists.
OPEN_THOUGHT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added tokens, not special ones: decoding keeps them, as Qwen3's does
CORPUS = ["What is 7 + 5? The answer is 12.", "Answer: 42", "\\boxed{3} #### 18", "user assistant system"]


def make_tokenizer(vocab_size: int = 300, chat_template: str = CHAT_TEMPLATE, think_tokens: bool = False):
    """A byte-level BPE tokenizer with a chat template; ids 0-2 are the special tokens. think_tokens adds
    <think> and </think> as single (non-special) tokens, as Qwen3's tokenizer has them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if think_tokens:
        tok.add_tokens(THINK_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=chat_template,
    )


def make_tiny_checkpoint(
    path: Path, family: str = "llama", seed: int = 0, chat_template: str = CHAT_TEMPLATE, **overrides
) -> Path:
    """Save a 2-layer random model of `family` (llama, qwen2, qwen3) plus tokenizer into path."""
    import transformers

    tokenizer = make_tokenizer(chat_template=chat_template)
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    config_class = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    if family == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(config_class(**kwargs))
    with torch.no_grad():  # random norms and biases, so a loader that ignores them fails the parity tests
        for name, param in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    ref.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama-family checkpoint with tokenizer, shared by the whole session (read-only)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def workers_root(tmp_path_factory) -> Path:
    """The folder every worker process of the suite (pytest-xdist) shares: the parent of their own."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]):
    """build(folder)'s result, built by the first worker that asks and read by every other (under a lock), so a
    module fixture that launches ranks runs once per suite, whichever workers its tests land on."""
    root = workers_root(tmp_path_factory)
    folder, result = root / name, root / f"{name}.pt"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker
            folder.mkdir()
            torch.save(build(folder), result)
    return torch.load(result, weights_only=False)


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"third-party data not found at {SHARED_DATA}")
    return SHARED_DATA


FAMILIES = {  # name -> (family, config overrides): every architectural switch the loader reads
    "llama": ("llama", {}),
    "llama-bias-tied": ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory) -> Path:
    family, overrides = FAMILIES[request.param]
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family, **overrides)


def hf_model(path):
    """The transformers model of a checkpoint directory: the reference our decoder is compared with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy machine each op's thread sync costs more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_equal_to(got: torch.Tensor, expected: torch.Tensor, rel: float = 1e-12) -> None:
    """got equals expected to `rel` of expected's largest entry: the bar of two float64 computations that
    differ only in the order of their sums."""
    error, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    assert got.shape == expected.shape and error <= rel * scale, f"off by {error:.3g}, {error / scale:.3g} relative"


class RecordingSGD(torch.optim.SGD):
    """Plain SGD (linear in the gradient, so a wrong normalization shows, where Adam would hide a constant
    factor) that keeps the gradient of every optimizer step."""

    def __init__(self, params):
        super().__init__(params, lr=1.0)
        self.grads = []

    def step(self, closure=None):
        self.grads.append(torch.cat([p.grad.flatten() for group in self.param_groups for p in group["params"]]))
        return super().step(closure)


# ----------------------------------------------------------------------------- training runs (test_train, test_rundir)

TIMING_KEYS = {"step_seconds", "rollout_tokens_per_s", "reward_seconds", "train_tokens_per_s"}


@pytest.fixture
def varied_rewards(monkeypatch):
    """A random model never solves a problem, so every advantage would be zero and nothing would train.
    Rewarding completions by the parity of their length gives the loop real, deterministic signal."""
    import train

    monkeypatch.setattr(train.reward, "reward", lambda texts, references, **_: [float(len(t) % 2) for t in texts])


def tiny_args(model_dir: Path, out_dir: Path, name: str, *extra: str) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--out-dir",
        str(out_dir),
        "--run-name",
        name,
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        "--lr",
        "1e-2",
        "--lora-rank",
        "4",
        "--eval-problems",
        "3",
        "--eval-k",
        "2",
        "--checkpoint-every",
        "2",
        *extra,
    ]


def run_training(argv: list[str]) -> dict:
    import config
    import train

    cfg, given, _ = config.parse_args(argv)
    if cfg.resume:
        cfg = config.resumed_config(cfg, given)
    return train.train(cfg)


class Command:
    """A command forked by fork_command, with the part of subprocess.Popen's interface the tests and the
    study scripts use."""

    def __init__(self, process: multiprocessing.Process):
        self.process, self.pid = process, process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, signum: int) -> None:
        """As Popen's: nothing once the process has ended."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout)
        return self.process.exitcode


def start_fork_server() -> None:
    """Start multiprocessing's fork server, once per test process, for both of its users: fork_command's
    commands and test_distributed's ranks (a process has one server, so it preloads what both need:
    tests/forked.py's list and the ranks' workers in test_fsdp and test_distributed, which test_fsdp imports).
    The server is a fresh interpreter that imports its preload by name and skips, without a word, what fails
    to import; Python 3.11's server does not take this process's sys.path, so it starts with it as PYTHONPATH."""
    from multiprocessing import forkserver

    import forked

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(sys.path))
        multiprocessing.set_forkserver_preload([*forked.PRELOAD, "test_fsdp"])
        forkserver.ensure_running()


def fork_command(argv: list[str], stdout: Path, stderr: Path, cwd: Path = ROOT) -> Command:
    """`python ARGV` (a script of the project, or -m MODULE) in a process of its own, forked from a fork server
    that imported the commands' modules once (tests/forked.py), as test_distributed's ranks are; its stdout
    and stderr appended to the two files (the same one for both is fine)."""
    import forked

    start_fork_server()
    process = multiprocessing.get_context("forkserver").Process(
        target=forked.run, args=(argv, dict(os.environ), str(cwd), str(stdout), str(stderr)), name=argv[0]
    )
    process.start()
    return Command(process)


def launch(args: list[str], log: Path, script: str = "train.py") -> Command:
    """`python SCRIPT ARGS` (train.py, sft.py) in its own process (fork_command), so a test can signal it. Its
    stderr (progress bars, tracebacks) goes to a file: a pipe nobody reads would fill up and stall the run.
    launch_as_typed starts the command itself."""
    log.write_text("")
    return fork_command([script, *args], Path(os.devnull), log)


def launch_as_typed(args: list[str], log: Path, script: str = "train.py") -> subprocess.Popen:
    """`python SCRIPT ARGS` started as a user types it: a fresh interpreter that imports everything itself."""
    with log.open("w") as stderr:
        return subprocess.Popen([sys.executable, script, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)


COMMANDS = {str(ROOT / script) for script in ("train.py", "sft.py", "eval.py")}


@pytest.fixture
def forked_commands(monkeypatch):
    """subprocess.Popen starts the project's own commands (`python train.py ...`, `python -m research.NAME ...`,
    their output to a file) through fork_command; anything else it starts as it would."""
    real_popen = subprocess.Popen

    def popen(argv, *args, stdout=None, stderr=None, cwd=None, **kwargs):
        project = (
            isinstance(argv, list)
            and not args
            and not kwargs
            and argv[0] == sys.executable
            and (argv[1] in COMMANDS or argv[1] == "-m" and argv[2].startswith("research."))
            and isinstance(getattr(stdout, "name", None), str)  # a file opened by its path
            and (stderr == subprocess.STDOUT or isinstance(getattr(stderr, "name", None), str))
        )
        if not project:
            return real_popen(argv, *args, stdout=stdout, stderr=stderr, cwd=cwd, **kwargs)
        out = Path(stdout.name)
        err = out if stderr == subprocess.STDOUT else Path(stderr.name)
        return fork_command(argv[1:], out, err, Path(cwd or os.getcwd()))

    monkeypatch.setattr(subprocess, "Popen", popen)


def metric_lines(run_dir: Path) -> list[dict]:
    """The steps' lines of metrics.jsonl, without their timings (a resume's event lines are not steps)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines if "event" not in line]


def event_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "event" in line]


def latest_step(run_dir: Path) -> int:
    """The step of the checkpoint the run's `latest` names."""
    return int((run_dir / "latest").read_text().split("-")[1])
