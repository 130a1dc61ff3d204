"""The codec library's import graph: no cycles, no CLI imports, no private names across modules."""

from __future__ import annotations

import ast
from pathlib import Path

import seqkv_codecs

ROOT = Path(seqkv_codecs.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, list[tuple[str, list[str]]]]:
    """{module: [(imported module, names)]} for every import, module level or in a function."""
    graph = {}
    for path in sorted(ROOT.rglob("*.py")):
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.append((node.module, [alias.name for alias in node.names]))
        graph[_module(path)] = found
    return graph


def _edges(graph) -> dict[str, set[str]]:
    """Module -> library modules it imports; ``from pkg import sub`` points at ``pkg.sub``."""
    edges = {}
    for m, found in graph.items():
        targets = set()
        for t, names in found:
            subs = [f"{t}.{n}" for n in names if f"{t}.{n}" in graph]
            targets.update(subs if subs and len(subs) == len(names) else [t, *subs])
        edges[m] = {t for t in targets if t in graph and t != m}
    return edges


def test_no_import_cycles_inside_the_library():
    edges = _edges(_imports())
    done, path = set(), []

    def visit(m: str) -> None:
        if m in path:
            raise AssertionError(" -> ".join([*path[path.index(m) :], m]))
        if m in done:
            return
        path.append(m)
        for t in sorted(edges[m]):
            visit(t)
        path.pop()
        done.add(m)

    for m in sorted(edges):
        visit(m)


def test_no_cli_imports_and_no_private_names_across_modules():
    for module, found in _imports().items():
        for target, names in found:
            assert not target.startswith("seqkv_cli"), f"{module} imports {target}"
            private = [n for n in names if n.startswith("_") and n != "__future__"]
            assert not private or target == module, f"{module} imports {private} from {target}"
