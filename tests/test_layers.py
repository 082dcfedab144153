"""The house reads one way: no import circles, and no import from the core or the app definition up into
the worker stack or the producers (docs/development.md, "Layers").

The graph is read from the source with ``ast`` (every ``import`` and ``from ... import``, also those
inside functions and under ``TYPE_CHECKING``: a lazy import is still a dependency), over ``ttsq/`` and
the folders installed as ``ttsq.cli`` and ``ttsq.workers``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folders and the package name each is installed as (pyproject.toml, [tool.setuptools]).
PACKAGES = {"ttsq": ROOT / "ttsq", "ttsq.cli": ROOT / "cli", "ttsq.workers": ROOT / "workers"}

CORE = {
    "ttsq",
    "ttsq.constants",
    "ttsq.errors",
    "ttsq.config",
    "ttsq.request",
    "ttsq.keys",
    "ttsq.engines.base",
    "ttsq.audio",
    "ttsq.storage",
    "ttsq.connection",
    "ttsq.redaction",
    "ttsq.cache",
    "ttsq.ledger",
    "ttsq.stats",
    "ttsq.broker",
    "ttsq.results",
    "ttsq.observer",
    "ttsq.health",
    "ttsq.voices",
    "ttsq.splitter",
    "ttsq.document",
    "ttsq.fidelity",
    "ttsq.envelope",
    "ttsq.accepted",
    "ttsq.apikeys",
}
APP = {"ttsq.app"}
#: The worker stack, top down: a module may import its own rank or lower ranks, never a higher one.
WORKER = [
    {"ttsq.tasks", "ttsq.consumer"},
    {"ttsq.orchestrator"},
    {"ttsq.worker"},
    {"ttsq.metrics", "ttsq.watchdog", "ttsq.sweeper", "ttsq.gate"},
    {"ttsq.batching"},
    {"ttsq.batch_scheduler", "ttsq.slot_scheduler"},
    {"ttsq.intake"},
    {
        "ttsq.engines",
        "ttsq.engines.espeak",
        "ttsq.engines.qwen",
        "ttsq.engines.qwen_fast",
        "ttsq.engines.qwen_decode",
        "ttsq.engines.qwen_layers",
        "ttsq.engines.qwen_codec",
        "ttsq.engines.qwen_quant",
        "ttsq.engines.qwen_sampling",
        "ttsq.engines.qwen_checkpoint",
    },
]
PRODUCERS = {
    "ttsq.client",
    "ttsq.fleet",
    "ttsq.speech",
    "ttsq.waiter",
    "ttsq.apierror",
    "ttsq.gateway",
    "ttsq.routes",
    "ttsq.server",
}
#: What starts processes and composes both stacks (the command line, the worker entrypoint, the launcher,
#: the embedded mode, operations tools): free to import anything below it.
ENTRYPOINTS = {
    "ttsq.embedded",
    "ttsq.supervisor",
    "ttsq.devices",
    "ttsq.flower",
    "ttsq.ops",
    "ttsq.ops.bench",
    "ttsq.ops.corpus",
    "ttsq.ops.report",
    "ttsq.cli",
    "ttsq.cli.main",
    "ttsq.cli.common",
    "ttsq.cli.jobs",
    "ttsq.cli.voices",
    "ttsq.cli.fleet",
    "ttsq.cli.bench",
    "ttsq.cli.gateway",
    "ttsq.workers",
    "ttsq.workers.celery_worker",
}
#: Imported only inside the qwen engines.
HEAVY = ("torch", "transformers", "qwen_tts", "torchaudio")
HEAVY_ALLOWED = {
    "ttsq.engines.qwen",
    "ttsq.engines.qwen_fast",
    "ttsq.engines.qwen_decode",
    "ttsq.engines.qwen_layers",
    "ttsq.engines.qwen_codec",
    "ttsq.engines.qwen_quant",
    "ttsq.engines.qwen_sampling",
    "ttsq.engines.qwen_checkpoint",
}


def layer_of(module: str) -> tuple[str, int]:
    if module in CORE:
        return "core", 0
    if module in APP:
        return "app", 0
    for rank, modules in enumerate(WORKER):
        if module in modules:
            return "worker", rank
    if module in PRODUCERS:
        return "producer", 0
    if module in ENTRYPOINTS:
        return "entrypoint", 0
    raise KeyError(module)


def modules() -> dict[str, Path]:
    """Every module of the house, by the name it is imported as."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The house's modules that ``module`` imports (the longest known prefix of each imported name)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for name in names:
            parts = name.split(".")
            for end in range(len(parts), 0, -1):
                candidate = ".".join(parts[:end])
                if candidate in known and candidate != module:
                    out.add(candidate)
                    break
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {module: imports(path, module, set(found)) for module, path in found.items()}


def heavy_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        out |= {name for name in names if name.split(".")[0] in HEAVY}
    return out


def test_every_module_has_a_place_in_the_layers() -> None:
    unplaced = []
    for module in modules():
        try:
            layer_of(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"place these in tests/test_layers.py (and docs/development.md): {unplaced}"


#: A product module may grow past this many lines only with a reason in its docstring.
LONG_MODULE_LINES = 400


def test_a_long_module_says_why_it_is_one_file() -> None:
    unexplained = []
    for module, path in modules().items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if lines > LONG_MODULE_LINES and f"Why one file over {LONG_MODULE_LINES} lines:" not in docstring:
            unexplained.append(f"{module} ({lines} lines)")
    assert not unexplained, f'say "Why one file over {LONG_MODULE_LINES} lines: ..." in their docstrings: {unexplained}'


def test_no_import_circles() -> None:
    edges = graph()
    names = modules()
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not circles, "import circles: " + "; ".join(
        " -> ".join(str(names[m].relative_to(ROOT)) for m in circle) for circle in circles
    )


def test_imports_run_one_way() -> None:
    allowed = {
        "core": {"core"},
        "app": {"core", "app"},
        "worker": {"core", "app", "worker"},
        "producer": {"core", "app", "producer"},
    }
    names = modules()
    wrong = []
    for source, targets in graph().items():
        layer, rank = layer_of(source)
        if layer == "entrypoint":
            continue
        for target in targets:
            target_layer, target_rank = layer_of(target)
            if target_layer not in allowed[layer] or (layer == target_layer == "worker" and target_rank < rank):
                wrong.append(
                    f"{names[source].relative_to(ROOT)} ({layer}) imports "
                    f"{names[target].relative_to(ROOT)} ({target_layer})"
                )
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_torch_transformers_and_qwen_tts_stay_inside_the_qwen_engines() -> None:
    wrong = {
        module: sorted(heavy)
        for module, path in modules().items()
        if module not in HEAVY_ALLOWED and (heavy := heavy_imports(path))
    }
    assert not wrong, f"heavy imports outside the qwen engines: {wrong}"


@pytest.mark.parametrize(("source", "target"), [("ttsq.request", "ttsq.tasks"), ("ttsq.batching", "ttsq.worker")])
def test_the_checker_sees_a_forbidden_import(source: str, target: str, tmp_path: Path) -> None:
    """The rules above can fail: a core module reaching the worker stack, or the batcher reaching up to the
    runtime, is reported."""
    path = tmp_path / "probe.py"
    path.write_text(f"from __future__ import annotations\n\ndef late() -> None:\n    import {target}\n")
    found = imports(path, source, set(modules()))
    assert found == {target}
    layer, rank = layer_of(source)
    target_layer, target_rank = layer_of(target)
    assert target_layer != layer or target_rank < rank
