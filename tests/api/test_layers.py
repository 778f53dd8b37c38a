"""The package's folders are layers: each module imports only from its own layer or the ones below, and no
import circle exists anywhere (docs/architecture.md).

The rules, checked on the source (every ``import`` and ``from ... import`` of a ddpkit module, at the top
of a file or inside a function):

1. No upward import: a module's layer (``LAYERS``, bottom first) is at least that of everything it imports.
2. No circle: the import graph, function-level imports included, has no cycle (within a layer either).
3. Imports sit at the top of files. The one exception: a module that loads no torch when imported (the
   command line, the config, ``ddpkit plot``'s modules, show-data's) may import a ddpkit module that
   does inside a function, so that ``ddpkit --help``, a config error or a mistyped path stay instant.

An import under ``if TYPE_CHECKING:`` never runs: it names a type for readers and type checkers. It
must still not point upward, but it is no edge of a circle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import WAIT_S, cli_env

SRC = Path(__file__).resolve().parents[2] / "src"

# Bottom first. A name stands for that module, or for every module of that package.
LAYERS = (
    ("ddpkit.errors", "ddpkit.version", "ddpkit.files", "ddpkit.importpath"),  # no ddpkit imports but errors
    ("ddpkit.config", "ddpkit.recipes", "ddpkit.device"),  # what a run is: plain data, no torch
    ("ddpkit.ranks",),  # processes and the process group
    ("ddpkit.data", "ddpkit.models", "ddpkit.identity"),  # what it trains on, and what
    ("ddpkit.run",),  # what a run leaves behind
    ("ddpkit.train",),  # what runs on one rank
    ("ddpkit.trainer", "ddpkit.preflight", "ddpkit.loop"),  # the public API, and its checks before launch
    ("ddpkit.tools",),  # built on training
    ("ddpkit", "ddpkit.__main__", "ddpkit.cli", "ddpkit.commands"),  # the public face
)
HELP_ROOTS = ("ddpkit", "ddpkit.__main__", "ddpkit.cli")  # what `python -m ddpkit --help` starts from


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool | None]]:
    """(imported ddpkit module, where) for every import in ``path``; where: True at the top of the
    file, False inside a function, None under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    top = {id(node) for node in tree.body}
    typing_only = {
        id(n)
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(block)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        where = None if id(node) in typing_only else id(node) in top
        found += [(n, where) for n in names if n == "ddpkit" or n.startswith("ddpkit.")]
    return found


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph() -> dict[str, list[tuple[str, bool]]]:
    return {module_name(p): imports(p) for p in sorted((SRC / "ddpkit").rglob("*.py"))}


def layer_of(module: str) -> int:
    best = None
    for index, names in enumerate(LAYERS):
        for name in names:
            covers = module == name or (name != "ddpkit" and module.startswith(name + "."))
            if covers and (best is None or len(name) > len(best[1])):
                best = (index, name)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best[0]


def help_modules(graph: dict) -> set[str]:
    """What ``ddpkit --help`` imports: the top-of-file import closure of the CLI, parent packages included."""
    seen, todo = set(), list(HELP_ROOTS)
    while todo:
        module = todo.pop()
        if module in seen or module not in graph:
            continue
        seen.add(module)
        parents = [module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)]
        todo += parents + [target for target, at_top in graph[module] if at_top is True]
    return seen


HEAVY = ("torch", "numpy", "matplotlib", "PIL")  # what a module must not import at its top to start fast


def loads_torch(graph: dict) -> set[str]:
    """The modules whose import loads torch (or another heavy package): directly at their top, or through
    a ddpkit module they import at their top, or through a parent package's ``__init__``."""
    heavy = {m for m in graph if any(h.split(".")[0] in HEAVY for h in _top_external(m))}
    changed = True
    while changed:
        changed = False
        for module, targets in graph.items():
            if module in heavy:
                continue
            deps = [t for t, at_top in targets if at_top is True] + sorted(_parents(module))
            if any(d in heavy for d in deps):
                heavy.add(module)
                changed = True
    return heavy


def _top_external(module: str) -> list[str]:
    path = SRC.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(path.read_text())
    return [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names] + [
        n.module for n in tree.body if isinstance(n, ast.ImportFrom) and not n.level and n.module
    ]


def cycles(graph: dict) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan), plus self-imports."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, where in graph.get(v, ()):
            if w not in graph or where is None:  # a TYPE_CHECKING import never runs
                continue
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
            if len(component) > 1 or any(t == v and where is not None for t, where in graph.get(v, ())):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def problems(graph: dict) -> list[str]:
    """Every broken rule (module docstring), one line each; empty when the package is layered."""
    found = []
    heavy = loads_torch(graph)
    for module, targets in sorted(graph.items()):
        for target, at_top in targets:
            if target == module or target in _parents(module):
                continue  # a package's own name: importing its submodule runs its __init__, not a cycle edge
            if layer_of(target) > layer_of(module):
                found.append(
                    f"upward import: {module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
                )
            if at_top is False and module in heavy:
                found.append(
                    f"import inside a function: {module} imports {target}; move it to the top "
                    f"(only a module that loads no torch may defer one)"
                )
    found += [f"import circle among: {', '.join(c)}" for c in cycles(graph)]
    return found


def _parents(module: str) -> set[str]:
    return {module.rsplit(".", k)[0] for k in range(1, module.count(".") + 1)}


def test_the_package_is_layered_without_circles():
    assert problems(import_graph()) == []


def test_every_module_is_in_a_layer():
    for module in import_graph():
        layer_of(module)


def test_a_circle_an_upward_import_and_a_deferred_import_are_caught():
    graph = import_graph()
    assert ("ddpkit.data.types", True) in graph["ddpkit.data.loader"]
    circle = {**graph, "ddpkit.data.types": graph["ddpkit.data.types"] + [("ddpkit.data.loader", True)]}
    assert problems(circle) == ["import circle among: ddpkit.data.loader, ddpkit.data.types"]
    # the root of the old five-file circle: validating a config reached up into the run dir's code
    upward = {**graph, "ddpkit.config": graph["ddpkit.config"] + [("ddpkit.run.rundir", False)]}
    found = problems(upward)
    assert "upward import: ddpkit.config (layer 1) imports ddpkit.run.rundir (layer 4)" in found
    assert any(f.startswith("import circle among: ddpkit.config,") and "ddpkit.run.rundir" in f for f in found)
    typing_only = {**graph, "ddpkit.config": graph["ddpkit.config"] + [("ddpkit.run.rundir", None)]}
    assert problems(typing_only) == ["upward import: ddpkit.config (layer 1) imports ddpkit.run.rundir (layer 4)"]
    deferred = {**graph, "ddpkit.train.engine": graph["ddpkit.train.engine"] + [("ddpkit.run.plots", False)]}
    assert problems(deferred) == [
        "import inside a function: ddpkit.train.engine imports ddpkit.run.plots; move it "
        "to the top (only a module that loads no torch may defer one)"
    ]


def test_help_plot_and_show_data_load_no_torch_at_import():
    heavy = loads_torch(import_graph())
    assert not help_modules(import_graph()) & heavy
    assert not {"ddpkit.run.plots", "ddpkit.run.records", "ddpkit.tools.showdata", "ddpkit.files"} & heavy
    assert {"ddpkit.train.engine", "ddpkit.ranks.context", "ddpkit.data"} <= heavy  # the rule can tell


@pytest.mark.multiprocess
def test_help_loads_no_torch():
    """``python -X importtime -m ddpkit --help`` lists every module it imports: torch is not among them."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpkit", "--help"],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "ddpkit.cli" in loaded and "ddpkit.commands.train" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "numpy")]
