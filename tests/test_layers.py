"""The house reads one way: no import circles, and imports that run down the layers only
(docs/development.md, "Layers").

Layers are read from where a module lives, not from a table: a new module in ``ttsq/records/`` is a
record, one in ``ttsq/worker/`` is the worker's. The graph is read from the source with ``ast`` (every
``import`` and ``from ... import``, also those inside functions and under ``TYPE_CHECKING``: a lazy
import is still a dependency), over ``ttsq/`` and the folders installed as ``ttsq.cli`` and
``ttsq.workers``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folders and the package name each is installed as (pyproject.toml, [tool.setuptools]).
PACKAGES = {"ttsq": ROOT / "ttsq", "ttsq.cli": ROOT / "cli", "ttsq.workers": ROOT / "workers"}

#: The layers, top down, each a list of module-name prefixes (a prefix matches itself and what lies
#: under it; the longest matching prefix wins). A module may import its own layer and any layer below
#: it, never one above; the two producer and worker stacks never import each other.
LAYERS: dict[str, tuple[str, ...]] = {
    # What starts processes and composes both stacks: free to import anything below it.
    "entrypoint": ("ttsq.cli", "ttsq.workers", "ttsq.ops", "ttsq.testing"),
    "producer": ("ttsq.client", "ttsq.gateway"),
    # kombu's transport as the worker consumes through it: the delivery room's one module of the worker's.
    "worker": ("ttsq.worker", "ttsq.delivery.transport"),
    "batching": ("ttsq.batching",),
    "engines": ("ttsq.engines",),
    "app": ("ttsq.app", "ttsq.sending", "ttsq.delivery.connection"),
    # The core: flat nouns, what Redis keeps, and the engine protocol every layer above speaks.
    "core": ("ttsq", "ttsq.records", "ttsq.engines.base"),
}
#: What each layer may import (its own layer included).
ALLOWED: dict[str, set[str]] = {
    "entrypoint": set(LAYERS),
    "producer": {"producer", "app", "core"},
    "worker": {"worker", "batching", "engines", "app", "core"},
    "batching": {"batching", "engines", "core"},
    "engines": {"engines", "core"},
    "app": {"app", "core"},
    "core": {"core"},
}
#: Libraries a layer must never import, whatever the module: the batcher is plain threads (its one
#: thread owns the engine), so Celery and kombu stay above it; the core and the records stay free of
#: the worker's Celery plumbing too (the app definition is the one core-side place Celery is named).
FORBIDDEN_LIBRARIES: dict[str, tuple[str, ...]] = {
    "batching": ("celery", "kombu"),
    "engines": ("celery", "kombu"),
}
#: Imported only inside the qwen engines (and the shipped checkpoint builders).
HEAVY = ("torch", "transformers", "qwen_tts", "torchaudio")
HEAVY_ALLOWED = ("ttsq.engines.qwen", "ttsq.testing.qwen_checkpoint", "ttsq.testing.aligner_checkpoint")


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str:
    """The layer of a module: its longest matching prefix."""
    if module == "ttsq":
        return "entrypoint"  # the package's face re-exports the client, the request and the errors
    best, length = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if _under(module, prefix) and len(prefix) > length:
                best, length = layer, len(prefix)
    if best is None:
        raise KeyError(module)
    return best


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


def library_imports(path: Path) -> set[str]:
    """Top-level names of the libraries a file imports (absolute imports only)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        out |= {name.split(".")[0] for name in names if name}
    return out


def heavy_imports(path: Path) -> set[str]:
    return {name for name in library_imports(path) if name in HEAVY}


def test_every_package_of_the_house_is_installed() -> None:
    """A folder of modules that pyproject.toml does not list is left out of the wheel: the installed
    command then fails on its first import of it (the README's fresh-copy test found ``ttsq.tracing`` so)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert packages - listed == set(), "add them to [tool.setuptools] packages in pyproject.toml"


def test_every_module_has_a_place_in_the_layers() -> None:
    assert {layer_of(module) for module in modules()} == set(LAYERS)


#: ``ttsq/``'s top level: a few flat core nouns; anything more finds a folder by layer.
TOP_LEVEL_MODULES = 20


def test_the_top_level_holds_only_the_core_nouns() -> None:
    flat = sorted(p.stem for p in (ROOT / "ttsq").glob("*.py") if p.stem != "__init__")
    assert len(flat) <= TOP_LEVEL_MODULES, f"ttsq/ holds {len(flat)} modules; give some a folder: {flat}"


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


def wrong_imports(edges: dict[str, set[str]]) -> list[str]:
    """Every import that runs against the layers, as ``source (layer) imports target (layer)``."""
    wrong = []
    for source, targets in edges.items():
        layer = layer_of(source)
        for target in targets:
            if layer_of(target) not in ALLOWED[layer]:
                wrong.append(f"{source} ({layer}) imports {target} ({layer_of(target)})")
    return sorted(wrong)


def test_imports_run_one_way() -> None:
    wrong = wrong_imports(graph())
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_batcher_and_the_engines_never_import_celery() -> None:
    wrong = {
        module: sorted(found)
        for module, path in modules().items()
        if (found := library_imports(path) & set(FORBIDDEN_LIBRARIES.get(layer_of(module), ())))
    }
    assert not wrong, f"Celery below the worker: {wrong}"


def test_torch_transformers_and_qwen_tts_stay_inside_the_qwen_engines() -> None:
    wrong = {
        module: sorted(heavy)
        for module, path in modules().items()
        if not any(_under(module, prefix) for prefix in HEAVY_ALLOWED) and (heavy := heavy_imports(path))
    }
    assert not wrong, f"heavy imports outside the qwen engines: {wrong}"


#: kombu's transport and connection (not its public utilities, such as its JSON codec): only the delivery
#: room touches them (docs/development.md, "Layers"), so one fence covers every override.
KOMBU_INTERNALS = ("kombu.transport", "kombu.connection")


def kombu_internals(path: Path) -> set[str]:
    """The kombu transport and connection modules a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        found |= {name for name in names if any(_under(name, prefix) for prefix in KOMBU_INTERNALS)}
    return found


def test_only_the_delivery_room_touches_kombus_transport(tmp_path: Path) -> None:
    wrong = {
        module: sorted(found)
        for module, path in modules().items()
        if not _under(module, "ttsq.delivery") and (found := kombu_internals(path))
    }
    assert not wrong, f"kombu's transport outside ttsq/delivery/: {wrong}"
    # The checker sees one, written either way.
    probe = tmp_path / "probe.py"
    probe.write_text("from kombu.transport import redis\nimport kombu.connection\nfrom kombu.utils import json\n")
    assert kombu_internals(probe) == {"kombu.transport", "kombu.transport.redis", "kombu.connection"}


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("ttsq.job", "ttsq.worker.tasks"),  # the core reaching the worker stack
        ("ttsq.records.cache", "ttsq.batching.batcher"),  # a record reaching the batcher
        ("ttsq.batching.batcher", "ttsq.worker.runtime"),  # the batcher reaching up to the runtime
        ("ttsq.worker.runtime", "ttsq.gateway.state"),  # one stack reaching the other
        ("ttsq.gateway.routes", "ttsq.worker.tasks"),
        ("ttsq.engines.espeak", "ttsq.batching.jobs"),
    ],
)
def test_the_checker_sees_a_forbidden_import(source: str, target: str, tmp_path: Path) -> None:
    """The rules can fail: each of these imports, written into a module, is reported."""
    path = tmp_path / "probe.py"
    path.write_text(f"from __future__ import annotations\n\ndef late() -> None:\n    import {target}\n")
    found = imports(path, source, set(modules()))
    assert found == {target}
    assert wrong_imports({source: found}) == [f"{source} ({layer_of(source)}) imports {target} ({layer_of(target)})"]


def test_the_checker_sees_celery_in_the_batcher(tmp_path: Path) -> None:
    path = tmp_path / "probe.py"
    path.write_text("from __future__ import annotations\n\nfrom celery import Celery\n")
    assert library_imports(path) & set(FORBIDDEN_LIBRARIES["batching"]) == {"celery"}


def test_the_package_face_exports_the_client_the_request_the_result_and_the_errors() -> None:
    """``from ttsq import Client, SynthesisRequest, JobResult`` and the error tree; importing the package
    loads no Celery until ``Client`` is asked for (a tool that wants ``ttsq.errors`` pays nothing)."""
    code = (
        "import sys, ttsq\n"
        "assert 'celery' not in sys.modules, 'import ttsq loaded celery'\n"
        "from ttsq import Client, JobResult, SynthesisRequest, TTSQError, InvalidRequest, __version__\n"
        "from ttsq.client import Client as Direct\n"
        "assert Client is Direct and issubclass(InvalidRequest, TTSQError) and __version__\n"
        "assert sorted(ttsq.__all__) == sorted(set(ttsq.__all__))\n"
        "for name in ttsq.__all__: getattr(ttsq, name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
