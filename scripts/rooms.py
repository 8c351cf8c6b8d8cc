"""The largest rooms of the package and its import cycles.

Run from the repository root: ``python scripts/rooms.py [PACKAGE_DIR]`` (default ``ckptstore``). Prints the
modules over 600 lines, classes over 300 lines, functions over 80 lines, and every import cycle (strongly
connected component of the import graph). Function-local imports count; ``from PKG import name`` counts as
an import of the submodule ``PKG.name`` when there is one, else of ``PKG``.
"""

from __future__ import annotations

import ast
import os
import sys

LIMITS = {"modules": 600, "classes": 300, "functions": 80}


def module_name(path: str) -> str:
    name = path[:-3].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def read_package(root: str) -> dict[str, tuple[str, ast.Module, int]]:
    """``{module name: (path, tree, lines)}`` of every ``.py`` file under ``root``."""
    out = {}
    for folder, _dirs, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    src = fh.read()
                out[module_name(path)] = (path, ast.parse(src), len(src.splitlines()))
    return out


def imports_of(me: str, path: str, tree: ast.Module, known: set[str]) -> set[str]:
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            subs = {f"{base}.{a.name}" for a in node.names} & known
            found |= subs
            if len(subs) < len(node.names) and base in known:
                found.add(base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & known
    found.discard(me)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main(root: str = "ckptstore") -> None:
    pkg = read_package(root)
    sizes = {"modules": [], "classes": [], "functions": []}
    for path, tree, lines in pkg.values():
        sizes["modules"].append((lines, path))
        for node in ast.walk(tree):
            n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef):
                sizes["classes"].append((n, f"{path}:{node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sizes["functions"].append((n, f"{path}:{node.name}"))
    for kind, limit in LIMITS.items():
        print(f"{kind} > {limit} lines:")
        for n, where in sorted(sizes[kind], reverse=True):
            if n > limit:
                print(f"  {n:5d} {where}")
    known = set(pkg)
    graph = {m: imports_of(m, path, tree, known) for m, (path, tree, _n) in pkg.items()}
    found = cycles(graph)
    print(f"import cycles: {len(found)}")
    for comp in found:
        print("  " + " <-> ".join(comp))


if __name__ == "__main__":
    main(*sys.argv[1:2])
