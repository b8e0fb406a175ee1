"""The project's import graph, read from the source with ``ast`` (nothing is imported): no import circle among its
modules, and no module importing a layer above its own. Imports inside functions and under ``if TYPE_CHECKING``
count as any other: a circle hidden in a function is still a circle.

The layers, lowest first (docs/architecture.md draws them): ``models/`` (Hugging Face modules as stages) <-
``parallel/`` (the layout, the engines and each axis) <- ``data/`` and ``training/`` (training may read data, data
never training) <- the entry points (``train.py``, ``convert2ckpt.py``, ``scripts/*``), which nothing imports. Beside
them the developers' layers: ``tools/`` (the rank launcher, the docs generators) may import the packages, and
``benchmarks/`` the packages and ``tools/``. ``tests/`` may import anything.
"""

from __future__ import annotations

import ast
import collections
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIPPED_DIRS = {"work", "outputs", "__pycache__"}  # besides hidden directories and virtualenvs (.venv*)
PACKAGES = ("models", "parallel", "data", "training")
ENTRY, TOOLS, BENCHMARKS, TESTS = "entry point", "tools", "benchmarks", "tests"
# Which layers each layer may import (its own included).
MAY_IMPORT = {
    "models": {"models"},
    "parallel": {"models", "parallel"},
    "data": {"models", "parallel", "data"},
    "training": {"models", "parallel", "data", "training"},
    ENTRY: set(PACKAGES),
    TOOLS: {*PACKAGES, TOOLS},
    BENCHMARKS: {*PACKAGES, TOOLS, BENCHMARKS},
    TESTS: {*PACKAGES, ENTRY, TOOLS, BENCHMARKS, TESTS},
}


def project_modules(root: str = REPO) -> dict[str, str]:
    """Dotted module name -> file, for every .py file of the project (train, scripts.preflight, models.specs, ...)."""
    modules = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIPPED_DIRS and not x.startswith((".", "venv")))
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), root)[: -len(".py")].replace(os.sep, ".")
                modules[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return modules


def layer(module: str) -> str:
    top = module.split(".")[0]
    return top if top in (*PACKAGES, TOOLS, BENCHMARKS, TESTS) else ENTRY


def imported_names(node: ast.AST, package: str) -> list[str]:
    """The dotted names an import statement may refer to (``from a import b``: a.b, then a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        parts = package.split(".") if package else []
        base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(modules: dict[str, str]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        # A script's own directory is first on sys.path when it runs: `import x` beside it is <its dir>.x.
        beside = os.path.relpath(os.path.dirname(path), REPO).replace(os.sep, ".")
        edges = graph.setdefault(module, {})
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in statements(tree):
            for name in imported_names(node, package):
                for candidate in (name, f"{beside}.{name}" if beside != "." else name):
                    target = resolve(candidate, modules)
                    if target is not None and target != module and not module.startswith(f"{target}."):
                        edges.setdefault(target, node.lineno)
                        break
    return graph


def statements(tree: ast.Module):
    """Every statement of ``tree``, nested ones included (in functions, classes, ``if``, ``try``, ``with``, ``match``),
    in ``ast.walk``'s order: an import is a statement, and statements lie only in these bodies, so the expressions,
    nine in ten of the nodes, are not visited."""
    queue = collections.deque([tree])
    while queue:
        node = queue.popleft()
        yield node
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                queue.extend(n for n in value if isinstance(n, (ast.stmt, ast.excepthandler, ast.match_case)))


def resolve(name: str, modules: dict[str, str]) -> str | None:
    """The project module a dotted name lies in (models.specs.layer_file_name -> models.specs), or None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One import cycle (a -> b -> ... -> a) per strongly connected set of modules (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, targets = work[-1]
            w = next(targets, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.add(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(cycle_in(min(scc), scc, graph))
    return found


def cycle_in(start: str, scc: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside its strongly connected set (breadth first)."""
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if w in scc and w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is on no cycle of {sorted(scc)}")


def described(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, str]) -> str:
    steps = [f"{a} -> {b} ({os.path.relpath(modules[a], REPO)}:{graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return "circle: " + ", ".join(steps)


def upward_imports(graph: dict[str, dict[str, int]], modules: dict[str, str]) -> list[str]:
    return [
        f"{os.path.relpath(modules[module], REPO)}:{line}: {module} ({layer(module)}) imports {target} "
        f"({layer(target)}), a layer {layer(module)} may not import"
        for module, edges in sorted(graph.items())
        for target, line in sorted(edges.items())
        if layer(target) not in MAY_IMPORT[layer(module)]
    ]


@pytest.fixture(scope="module")
def project():
    """(modules, graph) of the project, parsed once for the checks below."""
    modules = project_modules()
    return modules, import_graph(modules)


def test_the_graph_is_read(project):
    """The parse finds the project (so that the checks below cannot pass on an empty graph)."""
    modules, graph = project
    assert {"train", "convert2ckpt", "scripts.preflight", "models.llama_pipe", "parallel.layout"} <= set(modules)
    assert {layer(m) for m in modules} == {*PACKAGES, ENTRY, TOOLS, BENCHMARKS, TESTS}
    assert "parallel.layout" in graph["training.configuration.schema"]  # a top-level import
    assert not any(m.startswith((".venv", "work.")) for m in modules)
    assert sum(len(edges) for edges in graph.values()) > 300


def test_no_import_circle(project):
    modules, graph = project
    found = [described(cycle, graph, modules) for cycle in circles(graph)]
    assert not found, "\n".join(found)


def test_no_module_imports_a_higher_layer(project):
    modules, graph = project
    upward = upward_imports(graph, modules)
    assert not upward, "\n".join(upward)


def test_the_checks_find_a_planted_circle_and_upward_import():
    """The checks on a small graph of their own: a circle hidden in a function, and models importing training."""
    names = ("models.a", "models.b", "models.c", "training.t", "train")
    modules = {m: os.path.join(REPO, *m.split(".")) + ".py" for m in names}
    graph = {
        "models.a": {"models.b": 1},
        "models.b": {"models.c": 2},
        "models.c": {"models.a": 3, "training.t": 4},
        "training.t": {"models.a": 1},
        "train": {"training.t": 1},
    }
    assert circles(graph) == [["models.a", "models.b", "models.c", "models.a"]]
    assert "models.c -> models.a (models/c.py:3)" in described(circles(graph)[0], graph, modules)
    (upward,) = upward_imports({"models.c": graph["models.c"]}, modules)
    assert upward.endswith("models.c (models) imports training.t (training), a layer models may not import")
    graph["models.a"]["train"] = 5  # an entry point imported
    assert len(upward_imports(graph, modules)) == 2


def test_every_script_puts_the_repo_on_its_module_path_before_importing_it(project):
    """``python scripts/x.py`` has scripts/ on its path, not the repo: a script importing the project inserts the
    repo first. (The suite runs scripts forked from a process that has imported the project, where a missing
    insert would go unnoticed.)"""
    modules, graph = project
    missing = []
    for module, edges in sorted(graph.items()):
        if not module.startswith("scripts.") or not any(layer(t) in PACKAGES for t in edges):
            continue
        first_import = min(line for t, line in edges.items() if layer(t) in PACKAGES)
        with open(modules[module]) as f:
            tree = ast.parse(f.read())
        inserts = [
            n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "sys.path.insert"
        ]
        if not inserts or min(inserts) > first_import:
            missing.append(f"{modules[module]}:{first_import}")
    assert not missing, missing
