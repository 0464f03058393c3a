"""No import circle anywhere in the project's packages.

A circle (a imports b, b imports a, however indirectly and whether at module
level or inside a function) is how a stage came to call back into its
caller; the house keeps one direction: the CLI over the suite over the
mirrors over weights. Read from the source with ast, nothing imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("weights", "impl_numpy", "impl_torch", "impl_tf", "impl_jax", "impl_mlx", "conformance",
            "examples/mha_examples")


def modules(root: Path, packages) -> dict[str, Path]:
    found = {}
    for package in packages:
        base = root / package
        for path in base.rglob("*.py"):
            parts = path.relative_to(base.parent).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, anywhere in its file. `from P import x` is an import of P.x
    where x is a module, else of P (where x is defined)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module] if node.level and node.module
                            else package[:len(package) - node.level + 1] if node.level else [node.module])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                edges.add(target if target in known else base)
    return {edge for edge in edges if edge in known and edge != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def graph_of(root: Path, packages) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_project_has_no_import_circle():
    graph = graph_of(ROOT, PACKAGES)
    assert len(graph) > 100, f"only {len(graph)} modules read: is the package list right?"
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


def test_a_circle_through_a_late_import_is_found(tmp_path):
    """The finder itself: a circle closed by an import inside a function (the kind that hid in chunked.py)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "dispatch.py").write_text("from .core import fused\n\ndef qkv_heads():\n    pass\n")
    (package / "core.py").write_text("def fused():\n    from pkg.dispatch import qkv_heads\n    return qkv_heads\n")
    (package / "leaf.py").write_text("from . import core\n")
    assert circles(graph_of(tmp_path, ["pkg"])) == [["pkg.core", "pkg.dispatch"]]


# The layers, top to bottom: a module may import its own layer and those below, never one above.
# The command line sits over the suite and the native backends (with their conventions tables) and the
# bench; all of them over the shared plumbing (console, io, logs) and the mirrors; the mirrors over weights.
LAYERS = (
    ("conformance.cli", "conformance.__main__", "conformance.bench"),
    ("conformance.suite", "conformance.native"),
    ("conformance.console", "conformance.io", "conformance.logs"),
    ("impl_numpy", "impl_torch", "impl_tf", "impl_jax", "impl_mlx"),
    ("weights",),
)


def layer_of(name: str) -> int | None:
    for depth, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return depth
    return None


def test_each_layer_imports_only_its_own_and_those_below():
    graph = graph_of(ROOT, PACKAGES)
    upward = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                    if layer_of(name) is not None and layer_of(target) is not None
                    and layer_of(target) < layer_of(name))
    assert not upward, "imports against the layers: " + "; ".join(upward)


FRAMEWORKS = ("torch", "tensorflow", "keras", "jax", "flax", "mlx", "transformers", "onnx", "onnxruntime", "keras_hub",
              "torchtune", "impl_torch", "impl_tf", "impl_jax", "impl_mlx", "mirrors", "conformance.suite.backends")


def test_reference_marked_files_look_for_no_framework():
    """A test file marked `reference` runs in the numpy env only (`tox -e all` deselects it: it would run
    the same again): it must import no framework or mirror, directly or through the backends registry, and
    skip on none (importorskip), or `all` would lose what it tests with the frameworks installed."""
    marked = [p for p in sorted((ROOT / "tests").glob("test_*.py"))
              if re.search(r"^pytestmark = pytest\.mark\.reference\b", p.read_text(), re.M)]
    assert len(marked) >= 10, [p.name for p in marked]
    for path in marked:
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        names |= {f"{node.module}.{alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  and node.module for alias in node.names}
        found = sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in FRAMEWORKS))
        assert not found, f"{path.name} is marked reference but imports {found}"
        assert "importorskip" not in path.read_text(), f"{path.name} is marked reference but skips on a framework"
