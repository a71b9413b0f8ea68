"""The package's layering rules, checked from its source.

* ``core/`` is pure Python: importing any ``inference_server.core`` module loads neither torch nor trio
  nor Quart (checked in a fresh interpreter, so nothing this test process imported can hide a violation).
* ``ipc/frames``, ``ipc/flow`` and ``ipc/messages`` (the cross-process channel's wire format, credit accounting
  and the engine split's messages) are pure Python too: importing them loads no trio (``ipc/channel`` is their
  trio shell).
* ``kernels/`` imports nothing of ``models/``.
* The module import graph of ``inference_server`` has no cycles. Edges come from every ``import`` and
  ``from ... import`` statement in a module, at any depth (function-level imports count: a lazy import
  hides a cycle, it does not remove it), including those under ``if TYPE_CHECKING:`` (a type-only cycle
  is still two layers that each know the other). ``import a.b.c`` is an edge to ``a.b.c`` only, not to
  the packages above it: their ``__init__`` runs too, but a package importing its own submodules is not
  a layering cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "inference_server"
PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "src" / PACKAGE
FORBIDDEN_IN_CORE = ("torch", "trio", "quart")

def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _resolve_relative(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_modules(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The package modules ``name`` imports: ``from a import b`` names ``a.b`` when that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_relative(name, path.name == "__init__.py", node) if node.level else node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        yield from (t for t in targets if t in known and t != name)


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: set(imported_modules(name, path, known)) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_graph_parser_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from inference_server.core import kv_manager\n    from . import block_pool\n")
    known = {"inference_server.core.kv_manager", "inference_server.core.block_pool", "inference_server.core"}
    found = set(imported_modules("inference_server.core.probe", probe, known))
    assert found == {"inference_server.core.kv_manager", "inference_server.core.block_pool"}


def test_find_cycles_reports_each_cycle_once() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert find_cycles(graph) == [["a", "b", "c"]]


def test_package_import_graph_is_acyclic() -> None:
    assert find_cycles(import_graph()) == []


def test_records_are_the_bottom_layer() -> None:
    """``records`` modules import nothing of the package outside ``records``."""
    graph = import_graph()
    records = [name for name in graph if name.split(".")[1:2] == ["records"]]
    assert len(records) >= 4
    for name in records:
        above = {t for t in graph[name] if t.split(".")[1:2] != ["records"] and t != PACKAGE}
        assert not above, f"{name} imports {sorted(above)}"


def test_kernels_import_no_models() -> None:
    """``kernels`` modules (the Triton kernels and their reference oracles) import nothing of ``models``: the model
    code calls the kernels through the ops, never the other way round (lazy imports count)."""
    graph = import_graph()
    kernels = [name for name in graph if name.split(".")[1:2] == ["kernels"]]
    assert len(kernels) > 10
    for name in kernels:
        models = {t for t in graph[name] if t.split(".")[1:2] == ["models"]}
        assert not models, f"{name} imports {sorted(models)}"


def test_core_modules_import_no_torch_trio_or_quart() -> None:
    core = sorted(name for name in package_modules() if name.split(".")[1:2] == ["core"])
    assert len(core) > 5
    script = (
        "import importlib, json, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in {FORBIDDEN_IN_CORE!r} if m in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_ipc_wire_modules_import_no_trio() -> None:
    pure = [f"{PACKAGE}.ipc.frames", f"{PACKAGE}.ipc.flow", f"{PACKAGE}.ipc.messages"]
    assert set(pure) <= set(package_modules())
    script = (
        "import importlib, json, sys\n"
        f"for name in {pure!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in {FORBIDDEN_IN_CORE!r} if m in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
