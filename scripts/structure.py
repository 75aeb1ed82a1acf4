"""Structure figures from the real imports, lazy ones included (grimp, as import-linter reads them).

    scripts/check   # builds .typecheck/, the installed layout
    PYTHONPATH=.typecheck .venv/bin/python scripts/structure.py

Prints the number of modules, the longest import chain (layers) and where the node's command line
sits on it, and every "upward" import: one into a module that itself imports, directly or not,
back into the importer's own folder (a folder-level cycle: an arrow a newcomer sees run back up).
Then each folder's files and lines, and each package tree's split between its folders.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import grimp

TREE = Path(".typecheck/neuroshard")
PACKAGES = (
    "protocol",
    "tokenizer",
    "data",
    "node",
    "verifier",
    "api",
    "cli",
    "adversary",
    "testing",
    "swarm",
)
Graph = dict[str, frozenset[str]]


def import_graph(packages: list[str]) -> tuple[grimp.ImportGraph, Graph]:
    graph = grimp.build_graph(*packages)
    edges = {
        m: frozenset(b for b in graph.find_modules_directly_imported_by(m) if b.startswith("neuroshard."))
        for m in graph.modules
        if m.startswith("neuroshard.")
    }
    return graph, edges


def upward_imports(graph: grimp.ImportGraph, edges: Graph) -> list[tuple[str, str]]:
    def folder(module: str) -> str:
        return module if graph.find_children(module) else module.rsplit(".", 1)[0]

    @functools.cache
    def reach(module: str) -> frozenset[str]:
        seen: set[str] = set()
        stack = [module]
        while stack:
            for nxt in edges.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(seen)

    found = []
    for a, targets in edges.items():
        home = folder(a)
        for b in targets:
            inside = folder(b) == home or b.startswith(home + ".")
            if not inside and any(x == home or x.startswith(home + ".") for x in reach(b)):
                found.append((a, b))
    return sorted(found)


def layers(edges: Graph) -> dict[str, int]:
    """Each module's height: 1 for a module that imports none of ours, else 1 + the highest it
    imports. grimp's graph has no module-level cycle here (checked: a cycle raises)."""
    height: dict[str, int] = {}
    visiting: set[str] = set()
    sys.setrecursionlimit(10_000)

    def visit(module: str) -> int:
        if module in height:
            return height[module]
        if module in visiting:
            raise ValueError(f"import cycle through {module}")
        visiting.add(module)
        height[module] = 1 + max((visit(b) for b in edges.get(module, ())), default=0)
        visiting.discard(module)
        return height[module]

    for module in edges:
        visit(module)
    return height


def sizes() -> dict[str, tuple[int, int]]:
    """Folder (relative to the package root) -> (files, lines), migrations left out."""
    out: dict[str, tuple[int, int]] = {}
    found = [Path(d) / f for d, _, names in os.walk(TREE, followlinks=True) for f in names]
    for path in sorted(p for p in found if p.suffix == ".py"):
        if "migrations" in path.parts:
            continue
        folder = str(path.parent.relative_to(TREE))
        files, lines = out.get(folder, (0, 0))
        out[folder] = (files + 1, lines + len(path.read_text(encoding="utf-8").splitlines()))
    return out


def main() -> None:
    packages = [f"neuroshard.{p}" for p in PACKAGES if (TREE / p).exists()]
    graph, edges = import_graph(packages)
    height = layers(edges)
    print(f"modules {len(edges)}; import layers (longest chain) {max(height.values())}")
    for cli in ("neuroshard.node.cli", "neuroshard.cli.node"):
        if cli in height:
            print(f"{cli} sits at layer {height[cli]}")
    upward = upward_imports(graph, edges)
    print(f"upward imports (into a module that imports back into the importer's folder): {len(upward)}")
    for a, b in upward:
        print(f"  {a} -> {b}")
    folders = sizes()
    total = sum(lines for _, lines in folders.values())
    for folder, (files, lines) in folders.items():
        print(f"  {folder + '/':<16} {files:3d} files {lines:6d} lines")
    big = max(folders, key=lambda k: folders[k][1])
    print(f"largest folder {big}/: {folders[big][1]} lines, {folders[big][1] / total:.0%} of all {total}")
    for top in sorted({k.split("/")[0] for k in folders}):
        tree = {k: v[1] for k, v in folders.items() if k == top or k.startswith(top + "/")}
        if len(tree) > 1:
            whole = sum(tree.values())
            print(
                f"  {top}/ tree {whole} lines: " + ", ".join(f"{k}/ {n / whole:.0%}" for k, n in tree.items())
            )


if __name__ == "__main__":
    main()
