"""The project's import graph: read from every module's source with ast (imports inside functions
included), it has no cycle, and the decoder and the sampling rules import none of the engine."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGES = ("data", "engine", "grading", "infra", "research")  # beside the root's modules


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module of the project: the root's files and its packages' (not tests, benchmarks or examples)."""
    paths = [*ROOT.glob("*.py"), *(p for package in PACKAGES for p in (ROOT / package).glob("*.py"))]
    return {module_name(path): path for path in paths if path.name != "conftest.py"}


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports: `import a.b`, `from a import b` (b a module or a name in a) and
    relative imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a.b.c -> a.b -> a: the nearest project module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@functools.cache  # parsing every module takes a second; the tests only read the graph
def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_graph_reads_the_imports_it_should():
    """Plain, from- and relative imports, at the top of a file and inside a function (rollout.main's)."""
    graph = import_graph()
    assert {"model", "sampling", "engine.sampler", "engine.pool", "lora", "reward"} <= graph["rollout"]
    assert {"engine.pool", "engine.scheduler", "engine.kv_cache"} <= graph["engine.sampler"]
    assert {"infra.rundir", "infra.errors"} <= graph["eval"] and "infra.training" in graph["sft"]
    assert "data.templates" in graph["data"]


def test_no_module_imports_itself_through_others():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_dependencies_run_one_way():
    """The decoder and the sampling rules import none of the engine, rollout.py or the trainer; the engine does
    not import rollout.py; evaluation does not pull in the memory plan, and SFT does not import train.py."""
    graph = import_graph()
    assert reachable(graph, "model") == set()
    assert reachable(graph, "sampling") == set()
    engine = {name for name in graph if name.startswith("engine.")}
    assert all("rollout" not in reachable(graph, name) for name in engine)
    assert "engine.memory" not in reachable(graph, "eval") and "engine.sizes" not in reachable(graph, "eval")
    assert "train" not in reachable(graph, "sft") and "eval" not in graph["infra.rundir"]
