"""The project's import graph, checked: a DAG whose arrows point from the product to the paper.

Parses every .py file of the project with ``ast`` (the top-level modules, ``harness/`` and ``scale/``; with
``--tests`` also ``tests/``, ``bench/``, ``tools/`` and ``experiments/``) and collects the edges between the
project's own modules, imports inside functions ("lazy") included, and ``importlib.import_module("name")``
calls with a literal name. Imports under ``if TYPE_CHECKING:`` never run and are listed apart; so are those
under ``if __name__ == "__main__":`` (a program's entry, never run on import: ``python sat.py`` reaches the
command line there).

    python tools/check_imports.py            # prints the graph; exit 1 on a broken rule
    python tools/check_imports.py --tests    # the same with the tests, benchmarks, tools and experiments
    python tools/check_imports.py --tests --quiet   # CI: the verdict only, the graph too when a rule breaks

The layers: the paper's modules at the top level (``sat.py``, ``rollout.py``, ``advantage.py``, ...), the
product wing in ``harness/`` (command line, configuration, loading, tasks, records, checkpoints), scale-out in
``scale/``. Fails on
- any cycle of top-level or lazy edges;
- a paper module importing the product wing beyond the seam it is handed (``PAPER_MAY_IMPORT``: the processes;
  its settings are ``sat_config.SatConfig``, on the paper side; ``eval_aime.py``'s metrics also grade answers
  as the benchmarks do, ``harness.math_grading``), or importing ``scale/``;
- any import of ``sat`` by a paper module.
A paper module's ``__main__`` block may reach the product: ``python sat.py`` and ``python eval_aime.py`` run
their command lines (``harness.cli``, ``harness.evaluation``) from there.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a paper module may import of the product wing: the processes seam (its settings are sat_config.SatConfig)
PAPER_MAY_IMPORT = ("harness.processes",)
ALSO_MAY_IMPORT = {"eval_aime": ("harness.math_grading",)}  # Section 6's metrics grade as the benchmarks do
PACKAGES = ("harness", "scale")
OK_LINE = ("import graph: OK (a DAG; the paper's modules import from harness/ only the processes seam, and eval_aime "
           "the answer grader; never scale/)")
EXTRA_DIRS = ("tests", "bench", "tools", "experiments")  # importers only (with --tests)


def module_files(root: Path, with_tests: bool) -> dict[str, Path]:
    """Dotted module name -> file, for the project (top level, harness/, scale/) and optionally the extra folders."""
    files = {p.stem: p for p in sorted(root.glob("*.py"))}
    for package in PACKAGES:
        for p in sorted((root / package).glob("*.py")):
            files[package if p.stem == "__init__" else f"{package}.{p.stem}"] = p
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


def is_main_block(test: ast.expr) -> bool:
    """``if __name__ == "__main__":``"""
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


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
            elif isinstance(node, ast.If) and is_main_block(node.test) and child in node.body:
                visit(child, "main")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "type" if kind == "type" else "lazy")
            else:
                visit(child, kind)

    visit(tree, "top")
    return found


def build_graph(files: dict[str, Path]) -> dict[str, dict[str, str]]:
    """module -> {imported module: kind}; a module imported both ways counts as top-level."""
    known = set(files)
    rank = {"top": 0, "lazy": 1, "type": 2, "main": 3}
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
            if kind in ("type", "main"):
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
        deps = [w for w, kind in graph[v].items() if kind not in ("type", "main")]
        height[v] = 1 + max((h(w) for w in deps), default=-1)
        visiting.discard(v)
        return height[v]

    for v in graph:
        h(v)
    return height


def layer(module: str) -> str:
    """paper (top level), harness, scale, or extra (tests, benchmarks, tools, experiments)."""
    head = module.split(".")[0]
    if head in PACKAGES:
        return head
    return "extra" if head in EXTRA_DIRS else "paper"


def broken_rules(graph: dict[str, dict[str, str]], core: set[str]) -> list[str]:
    """One line per edge that points the wrong way (the module docstring's rules)."""
    out = []
    for v in sorted(core):
        for w, kind in sorted(graph[v].items()):
            if kind in ("type", "main"):
                continue
            if layer(v) != "paper":
                continue
            if w == "sat":
                out.append(f"TOP MODULE IMPORTED: {v} imports sat ({kind}); Algorithm 1 stays on top of the paper")
            elif layer(w) == "scale":
                out.append(f"SCALE-OUT IN THE PAPER: {v} imports {w} ({kind}); scale/ is reached through the "
                           "processes seam the harness hands in")
            elif layer(w) == "harness" and w not in PAPER_MAY_IMPORT + ALSO_MAY_IMPORT.get(v, ()):
                out.append(f"PRODUCT IN THE PAPER: {v} imports {w} ({kind}); a paper module takes from harness/ "
                           f"only {', '.join(PAPER_MAY_IMPORT)}")
    return out


def report(graph: dict[str, dict[str, str]], core: set[str], quiet: bool = False) -> int:
    """Print the graph (with ``quiet``, only when a rule breaks) and the verdict; 1 on a broken rule."""
    problems = [f"CYCLE: {' <-> '.join(comp)}" for comp in cycles(graph)] + broken_rules(graph, core)
    if not (quiet and not problems):
        print_graph(graph)
    for line in problems:
        print(line)
    print(OK_LINE if not problems else "import graph: FAILED")
    return 1 if problems else 0


def print_graph(graph: dict[str, dict[str, str]]) -> None:
    height = levels(graph)
    kinds = [kind for deps in graph.values() for kind in deps.values()]
    n = {k: kinds.count(k) for k in ("top", "lazy", "type", "main")}
    print(f"{len(graph)} modules, {sum(n.values())} edges: {n['top']} top-level, {n['lazy']} lazy (inside functions), "
          f"{n['type']} type-checking only, {n['main']} in a __main__ block")
    for v in sorted(graph, key=lambda m: (-height[m], m)):
        line = f"[{height[v]}] {v} -> {', '.join(sorted(w for w, k in graph[v].items() if k == 'top')) or '-'}"
        for kind, label in (("lazy", "lazy"), ("type", "type-checking"), ("main", "__main__")):
            extra = sorted(w for w, k in graph[v].items() if k == kind)
            if extra:
                line += f" | {label}: {', '.join(extra)}"
        print(line)
    lazy_edges = [(v, w) for v in sorted(graph) for w, k in sorted(graph[v].items()) if k == "lazy"]
    print(f"lazy imports ({len(lazy_edges)}): " + (", ".join(f"{v} -> {w}" for v, w in lazy_edges) or "none"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tests", action="store_true", help="also parse tests/, bench/ and tools/ (as importers)")
    ap.add_argument("--quiet", action="store_true", help="print the graph only when a rule breaks (CI)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the project's root folder")
    args = ap.parse_args(argv)
    files = module_files(args.root, args.tests)
    core = set(module_files(args.root, False))
    return report(build_graph(files), core, args.quiet)


if __name__ == "__main__":
    sys.exit(main())
