"""The package picture of docs/ARCHITECTURE.md stays true.

Import rules between layers are import-linter contracts (pyproject.toml, run by .ci/run);
these tests check what the contracts do not: no import cycle between any two modules, and no
private name crossing a module boundary. grimp (import-linter's graph) counts imports inside
functions too, so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"seqkv_cli": ROOT / "seqkv_cli", "seqkv_codecs": ROOT / "codecs" / "seqkv_codecs"}


def strongly_connected(graph) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
                    out.append(sorted(component))
    return out


def import_graph() -> dict[str, set[str]]:
    g = grimp.build_graph(*PACKAGES)
    return {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    cycles = strongly_connected(import_graph())
    assert not cycles, "import cycles (imports inside functions count): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_graph_counts_imports_inside_functions():
    # cli.py imports the thread settings only inside main() (before torch loads OpenMP)
    assert "seqkv_cli.runtime.threads" in import_graph()["seqkv_cli.cli"]


def _module_of(path: Path, package: str, root: Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_crossings() -> list[str]:
    """`from x import _name` of a seqkv module other than the importer itself."""
    found = []
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            here = _module_of(path, package, root)
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                if not node.module.startswith(tuple(PACKAGES)) or node.module == here:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {alias.name}")
    return found


def test_no_private_name_is_imported_across_modules():
    assert private_crossings() == []


# Private attributes of objects seqkv does not own, each used for a reason (no public API).
THIRD_PARTY_PRIVATES = {
    # optimum-quanto's QuantizedCache layer keeps its quantized K/V under private names
    ("seqkv_cli/report/quanto.py", "layer._quantized_keys"),
    ("seqkv_cli/report/quanto.py", "layer._quantized_values"),
    ("seqkv_cli/report/quanto.py", "layer._dequantize"),
    # torch's OpOverload schema: the only way to read an op's argument names
    ("seqkv_cli/runtime/portable/op_policy.py", "func._schema"),
    ("seqkv_cli/runtime/portable/mode.py", "func._schema"),
    # torch's storage identity: the one key that tied parameters and their views share and
    # that still tells meta tensors apart (every meta storage's data_ptr is 0)
    ("seqkv_cli/runtime/checkpoint/store.py", "t.untyped_storage()._cdata"),
    # transformers' config: the attention/experts implementation is swapped for one call and
    # restored exactly (including "unset"), which the public setters cannot express
    ("seqkv_cli/runtime/portable/model.py", "c._attn_implementation_internal"),
    ("seqkv_cli/runtime/portable/model.py", "c._experts_implementation_internal"),
}


def private_attribute_uses() -> set[tuple[str, str]]:
    """`obj._name` (read or written) where obj is not self/cls: another object's privates."""
    found = set()
    for root in PACKAGES.values():
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Attribute):
                    continue
                if not node.attr.startswith("_") or node.attr.startswith("__"):
                    continue
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                found.add((str(path.relative_to(ROOT)), ast.unparse(node)))
    return found


def test_no_module_touches_another_objects_private_attributes():
    assert private_attribute_uses() - THIRD_PARTY_PRIVATES == set()


def test_the_public_functions_are_the_librarys_own_and_load_lazily():
    import inspect
    import subprocess
    import sys

    import seqkv_cli

    assert set(seqkv_cli.__all__) == {"SeqkvError", "__version__", *seqkv_cli._PUBLIC}
    for name in seqkv_cli._PUBLIC:
        function = getattr(seqkv_cli, name)
        kinds = {p.kind for p in inspect.signature(function).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, name  # no **options to guess
        assert function.__module__ != "seqkv_cli", name  # the function itself, no wrapper
    code = "import sys, seqkv_cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert loaded.stdout.strip() == "[]"  # `seqkv --help` stays fast
