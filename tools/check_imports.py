"""The project's import graph, checked: a DAG with sat.py and eval_aime.py on top.

Parses every .py file of the project with ``ast`` (the top-level modules and
``scale/``; with ``--tests`` also ``tests/``, ``bench/`` and ``tools/``) and
collects the edges between the project's own modules, imports inside functions
("lazy") included, and ``importlib.import_module("name")`` calls with a literal
name. Imports under ``if TYPE_CHECKING:`` never run and are listed apart.

    python tools/check_imports.py            # prints the graph; exit 1 on a cycle or an import of a top module
    python tools/check_imports.py --tests    # the same with the tests, benchmarks and tools as importers

Fails on any cycle of top-level or lazy edges, on any import of ``sat`` or
``eval_aime`` by another project module (only tests, benchmarks and tools may
import them), and on any import of ``scale/`` by a core module other than those
two: scale-out sits above the core and the core reaches it through one seam
(``processes.py``), so ``scale/`` imports the core, never the reverse.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("sat", "eval_aime")  # entry points: nothing in the core imports them
EXTRA_DIRS = ("tests", "bench", "tools")  # importers only (with --tests)


def module_files(root: Path, with_tests: bool) -> dict[str, Path]:
    """Dotted module name -> file, for the core (top level + scale/) and optionally the extra folders."""
    files = {p.stem: p for p in sorted(root.glob("*.py"))}
    for p in sorted((root / "scale").glob("*.py")):
        files["scale" if p.stem == "__init__" else f"scale.{p.stem}"] = p
    if with_tests:
        for d in EXTRA_DIRS:
            for p in sorted((root / d).rglob("*.py")):
                files[".".join(p.relative_to(root).with_suffix("").parts)] = p
    return files


def resolve(name: str, known: set[str]) -> str | None:
    """The longest project module that ``name`` (a dotted import path) names or lies inside."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, str, int]]:
    """(imported project module, kind, line) for each import in the file; kind is top | lazy | type."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module.rsplit(".", 1)[0] if "." in module else ""
    if path.name == "__init__.py":
        package = module
    found: list[tuple[str, str, int]] = []

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x / from .x import y
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
                base = ".".join([*up, base] if base else up)
            # "from scale import memory" names the module scale.memory; "from team import Agent" names team
            return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            return [node.args[0].value]
        return []

    def visit(node: ast.AST, kind: str) -> None:
        for name in targets(node):
            target = resolve(name, known)
            if target is not None and target != module:
                found.append((target, kind, getattr(node, "lineno", 0)))
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.If) and is_type_checking(node.test) and child in node.body:
                visit(child, "type")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "type" if kind == "type" else "lazy")
            else:
                visit(child, kind)

    visit(tree, "top")
    return found


def build_graph(files: dict[str, Path]) -> dict[str, dict[str, str]]:
    """module -> {imported module: kind}; a module imported both ways counts as top-level."""
    known = set(files)
    rank = {"top": 0, "lazy": 1, "type": 2}
    graph: dict[str, dict[str, str]] = {m: {} for m in files}
    for module, path in files.items():
        for target, kind, _ in imports_of(module, path, known):
            old = graph[module].get(target)
            if old is None or rank[kind] < rank[old]:
                graph[module][target] = kind
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), over top-level and lazy edges."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, kind in graph[v].items():
            if kind == "type":
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def levels(graph: dict[str, dict[str, str]]) -> dict[str, int]:
    """Height of each module above the bottom (0: imports no project module); cycles cut arbitrarily."""
    height: dict[str, int] = {}
    visiting: set[str] = set()

    def h(v: str) -> int:
        if v in height:
            return height[v]
        if v in visiting:
            return 0
        visiting.add(v)
        deps = [w for w, kind in graph[v].items() if kind != "type"]
        height[v] = 1 + max((h(w) for w in deps), default=-1)
        visiting.discard(v)
        return height[v]

    for v in graph:
        h(v)
    return height


def is_scale(module: str) -> bool:
    return module == "scale" or module.startswith("scale.")


def report(graph: dict[str, dict[str, str]], core: set[str]) -> int:
    height = levels(graph)
    n_top = sum(k == "top" for deps in graph.values() for k in deps.values())
    n_lazy = sum(k == "lazy" for deps in graph.values() for k in deps.values())
    n_type = sum(k == "type" for deps in graph.values() for k in deps.values())
    print(f"{len(graph)} modules, {n_top + n_lazy + n_type} edges: {n_top} top-level, "
          f"{n_lazy} lazy (inside functions), {n_type} type-checking only")
    for v in sorted(graph, key=lambda m: (-height[m], m)):
        top = sorted(w for w, k in graph[v].items() if k == "top")
        lazy = sorted(w for w, k in graph[v].items() if k == "lazy")
        typ = sorted(w for w, k in graph[v].items() if k == "type")
        line = f"[{height[v]}] {v} -> {', '.join(top) or '-'}"
        if lazy:
            line += f" | lazy: {', '.join(lazy)}"
        if typ:
            line += f" | type-checking: {', '.join(typ)}"
        print(line)
    lazy_edges = [(v, w) for v in sorted(graph) for w, k in sorted(graph[v].items()) if k == "lazy"]
    print(f"lazy imports ({len(lazy_edges)}): " + (", ".join(f"{v} -> {w}" for v, w in lazy_edges) or "none"))
    failed = 0
    for comp in cycles(graph):
        print(f"CYCLE: {' <-> '.join(comp)}")
        failed = 1
    for v in sorted(core):
        for w in sorted(graph[v]):
            if w in TOP and v not in TOP:
                print(f"TOP MODULE IMPORTED: {v} imports {w} ({graph[v][w]}); {', '.join(TOP)} must stay on top")
                failed = 1
            if is_scale(w) and not (is_scale(v) or v in TOP):
                print(f"SCALE-OUT IN THE CORE: {v} imports {w} ({graph[v][w]}); only {', '.join(TOP)} pick it")
                failed = 1
    print("import graph: OK (a DAG, sat and eval_aime on top, scale/ above the rest of the core)" if not failed
          else "import graph: FAILED")
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", action="store_true", help="also parse tests/, bench/ and tools/ (as importers)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the project's root folder")
    args = ap.parse_args(argv)
    files = module_files(args.root, args.tests)
    core = set(module_files(args.root, False))
    return report(build_graph(files), core)


if __name__ == "__main__":
    sys.exit(main())
