"""The package's import graph, read from the source (ast; nothing imported): no cycles, no
private name imported across packages, and the folder layout docs/architecture.md maps."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tilework"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path):
    """(target module, imported names, at module level?) of every tilework import in `path`,
    module-level and inside functions alike (a lazy import still makes an edge)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    # Imports for annotations only (`if TYPE_CHECKING:`) never run: no edge.
    typing_only = {id(inner) for node in tree.body if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or id(node) in typing_only:
            continue
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1])
            target = f"{base}.{node.module}" if node.module else base
        else:
            target = node.module or ""
        if not target.startswith("tilework"):
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            yield (sub if sub in MODULES else target), alias.name, id(node) in top


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _, _ in _imports(name, path):
            # A module importing its own package's __init__ (re-exports) is no edge back.
            if target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for target in edges:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycle():
    """Lazy imports (inside functions) count: a cycle they hide is still a cycle."""
    assert _cycles(_graph()) == []


def test_no_private_name_is_imported_from_another_package():
    """`from ..x import _name` reaches into another package's internals; inside one package
    (a module and its siblings) it is the package's own business."""
    crossing = []
    for name, path in MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target, imported, _ in _imports(name, path):
            owner = target if MODULES.get(target, Path()).name == "__init__.py" \
                else target.rpartition(".")[0]
            if imported.startswith("_") and not imported.startswith("__") \
                    and owner != package:
                crossing.append(f"{name} imports {target}.{imported}")
    assert crossing == [], "\n".join(crossing)


def test_the_top_level_holds_only_the_entry_points():
    """Everything else lives in a package that says what it holds (docs/architecture.md)."""
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "api.py", "cli.py", "errors.py", "testing.py"]
    for package in (p for p in ROOT.rglob("__init__.py")):
        assert ast.get_docstring(ast.parse(package.read_text())), f"{package}: no docstring"
