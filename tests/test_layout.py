"""The house rules of the code's layout (docs/architecture.md, "Layout"), read from the imports.

Static: every module under peer/ and bootstrap/ is parsed, not imported, and each import is
resolved to a module of this project, wherever it sits (module level or inside a function).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("peer/wire/anchormesh_pb2",)  # protoc output


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("peer", "bootstrap"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports anywhere in its file."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = (
                ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module or ""
            )
            candidates = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in MODULES and c != name}
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_graph_is_read() -> None:
    """The checks below are only as good as the graph: it must see the daemon's known imports."""
    assert "peer.pipeline.worker" in GRAPH["peer.daemon.main"]
    assert "peer.client.view" in GRAPH["peer.client.status"]


def test_the_product_never_imports_the_benchmarks() -> None:
    """Benchmarks sit outside the product's import graph: only the console entry point reaches
    them (to parse and run `anchormesh bench`)."""
    offenders = {
        m: sorted(d for d in deps if _inside(d, "peer.bench"))
        for m, deps in GRAPH.items()
        if not _inside(m, "peer.bench") and not _inside(m, "peer.cli")
    }
    assert not {m: d for m, d in offenders.items() if d}


def test_the_client_side_is_a_leaf() -> None:
    """Status, dashboard, export, ban and health depend on the wire and security only; the
    daemon, the training core and the tracker never import them. One exception: the tracker's
    /metrics endpoint serves the same JSON view as `anchormesh status --json` (client/view.py)."""
    allowed_users = ("peer.cli", "peer.demo", "peer.bench", "peer.client")
    offenders = {
        m: sorted(
            d for d in deps if _inside(d, "peer.client") and not (m == "bootstrap.node" and d == "peer.client.view")
        )
        for m, deps in GRAPH.items()
        if not any(_inside(m, a) for a in allowed_users)
    }
    assert not {m: d for m, d in offenders.items() if d}
    leaves = {d for m in GRAPH if _inside(m, "peer.client") for d in GRAPH[m]}
    assert not {
        d
        for d in leaves
        if any(_inside(d, p) for p in ("peer.daemon", "bootstrap", "peer.pipeline", "peer.dp", "peer.optim"))
    }


def test_no_import_cycles() -> None:
    """No module reaches itself through imports, lazy ones included (a lazy import that closes a
    cycle hides a layering mistake)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles


@pytest.mark.parametrize(
    "name", sorted(n for n, p in MODULES.items() if not str(p.relative_to(ROOT).with_suffix("")).startswith(GENERATED))
)
def test_modules_stay_small(name: str) -> None:
    """~400 lines at most; a longer module is one idea and its docstring says so, with why."""
    path = MODULES[name]
    lines = len(path.read_text().splitlines())
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert lines <= 400 or "Longer than 400 lines" in doc, (
        f"{path.relative_to(ROOT)}: {lines} lines and no 'Longer than 400 lines: why' in its docstring"
    )
