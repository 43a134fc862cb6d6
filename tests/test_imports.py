"""The package's shape: no import cycles among its modules, small modules, few top-level ones."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "jaxspeed"
#: The kernels, a package of their own beside jaxspeed, held to the same rules.
KERNELS = PACKAGE.parent / "pallas_kernels"
MAX_LINES = 400
MAX_TOP_LEVEL_MODULES = 8
#: Modules over `MAX_LINES`, each with why it may be: {path from the repository root: reason}.
LONG_MODULES: dict[str, str] = {
    "jaxspeed/attention/sequence_parallel.py": (
        "Ulysses and ring attention share the layout helpers and ring's custom VJP uses them "
        "all; 11 lines over"),
    "jaxspeed/attention/sparsity.py": (
        "DeepSpeed's six layout classes and the block reader, one concept; its checks and mask "
        "pieces are modules of their own already"),
    "pallas_kernels/block_sparse_attention_mgpu.py": (
        "one Mosaic GPU kernel family (forward, dq, dk/dv, each with its warpgroup pipeline) "
        "and its tiling; what it shares with the Triton family is in _sparse_shared"),
    "pallas_kernels/moe_kernels_mgpu.py": (
        "one Mosaic GPU kernel family (dispatch, combine, combine's weight gradient) and its "
        "shared-memory budget; 27 lines over"),
}


README = PACKAGE.parent / "README.md"


def readme_table() -> tuple[tuple[str, ...], ...]:
    """The README's Architecture table, top row first: each row's packages (the backticked
    names of its first column). A package imports only from rows below it; the kernels
    (`pallas_kernels`) sit below them all."""
    text = README.read_text().split("## Architecture", 1)[1]
    rows = text.split("| package | owns |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return tuple(tuple(name.strip("` ") for name in row.split("|")[1].split(","))
                 for row in rows)


ARCHITECTURE = readme_table()
#: Imports that run up the table, each inside a function (never at import time), and why:
#: {(importer, imported): reason}. None today: keep it so.
UPWARD: dict[tuple[str, str], str] = {}
#: `Engine` holds the compiled steps and the shardings; checkpoints, profiles and memory
#: reports live in `checkpoint` and `cost`.
MAX_ENGINE_LINES = 250

def _module_name(path: Path) -> str:
    """jaxspeed/train/engine.py → "jaxspeed.train.engine"; a package's `__init__` is the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[Path]:
    """Every module of jaxspeed and of the kernels."""
    return sorted([*PACKAGE.rglob("*.py"), *KERNELS.rglob("*.py")])


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in _sources()}


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool = False):
    """Every `import` and `from ... import` in `tree`, at any depth (functions included);
    those under `if TYPE_CHECKING:`, which never run, only with `type_checking`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        yield from _imports(node, type_checking)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: set[str]) -> set[str]:
    """The jaxspeed modules one import statement of `module` loads by name: `from a.b import c`
    is `a.b.c` when that is a module, else `a.b`."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    base = node.module or ""
    if node.level:  # relative: from the package that holds `module`
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    found = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            found.add(f"{base}.{alias.name}")
        elif base in modules:
            found.add(base)
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """module → the jaxspeed and kernel modules it imports (itself excluded); with
    `type_checking`, also those it imports only for type checkers."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _imports(tree, type_checking):
            edges |= _targets(node, name, is_package, set(modules))
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as `[a, b, ..., a]`, or None when it has none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path[-1])
                on_path.discard(path.pop())
            elif nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_imports_resolve_to_modules_and_skip_type_checking():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from jaxspeed.train import engine\n"
        "from jaxspeed.checkpoint.state import Checkpointer\n"
        "if TYPE_CHECKING:\n"
        "    from jaxspeed.config import Config\n"
        "def f():\n"
        "    import jaxspeed.cost.hlo\n"
        "    from . import step\n"
    )
    modules = set(_modules())
    found = set()
    for node in _imports(ast.parse(source)):
        found |= _targets(node, "jaxspeed.train.loop", False, modules)
    assert found == {
        "jaxspeed.train.engine", "jaxspeed.checkpoint.state", "jaxspeed.cost.hlo",
        "jaxspeed.train.step",
    }


def test_the_package_has_no_import_cycles():
    """Not even through imports for type checkers: a cycle there is a design knot too."""
    cycle = find_cycle(import_graph(type_checking=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_kernels_import_nothing_of_jaxspeed():
    """`pallas_kernels` is the bottom of the house: jaxspeed imports it, never the reverse."""
    up = sorted((module, target) for module, targets in import_graph(type_checking=True).items()
                if module.startswith("pallas_kernels") for target in targets
                if target.startswith("jaxspeed"))
    assert not up, f"the kernels import jaxspeed: {up}"


def test_the_table_is_read_from_the_readme():
    assert ARCHITECTURE[0] == ("cli",) and ARCHITECTURE[-1] == ("errors", "tree_paths")
    assert ("attention", "moe", "pipeline") in ARCHITECTURE


def test_modules_are_small():
    long = {}
    for path in _sources():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[path.relative_to(PACKAGE.parent).as_posix()] = lines
    unexplained = {path: n for path, n in long.items() if path not in LONG_MODULES}
    assert not unexplained, f"modules over {MAX_LINES} lines (split them): {unexplained}"
    stale = sorted(set(LONG_MODULES) - set(long))
    assert not stale, f"no longer over {MAX_LINES} lines, drop them from LONG_MODULES: {stale}"


def test_the_config_loads_without_jax():
    """`import jaxspeed.config` (what the CLI reads flags and configs with) loads no JAX, Flax
    or kernels: the layers' option types come from `jaxspeed.options`."""
    code = ("import sys, jaxspeed.config; print(sorted(m for m in ('jax', 'flax', 'optax', "
            "'pallas_kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


def test_the_engine_is_thin():
    tree = ast.parse((PACKAGE / "train" / "engine.py").read_text())
    (engine,) = (node for node in tree.body if isinstance(node, ast.ClassDef)
                 and node.name == "Engine")
    lines = engine.end_lineno - engine.lineno + 1
    assert lines < MAX_ENGINE_LINES, f"Engine is {lines} lines: move what is not a step out"


def test_few_top_level_modules():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules in jaxspeed/: {top}"


def _package(module: str) -> str:
    """jaxspeed.train.engine → "train"; a top-level module is its own package."""
    return module.split(".")[1] if module.count(".") else module


def _top_level_imports(path: Path) -> set[str]:
    """The modules `path` imports when it is imported (not inside a function or class)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_imports_go_down_the_architecture_table():
    row = {package: i for i, packages in enumerate(ARCHITECTURE) for package in packages}
    modules = _modules()
    upward = set()
    for module, targets in import_graph().items():
        for target in targets:
            here, there = _package(module), _package(target)
            if here != there and here in row and there in row and row[there] <= row[here]:
                upward.add((module, target))
    unexplained = sorted(upward - set(UPWARD))
    assert not unexplained, f"imports up the README's Architecture table: {unexplained}"
    stale = sorted(set(UPWARD) - upward)
    assert not stale, f"no longer imported, drop them from UPWARD: {stale}"
    at_import = sorted((m, t) for m, t in UPWARD if t in _top_level_imports(modules[m]))
    assert not at_import, f"upward imports must stay inside a function: {at_import}"


def test_every_package_is_in_the_architecture_table():
    listed = {package for packages in ARCHITECTURE for package in packages}
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    top = {path.stem for path in PACKAGE.glob("*.py") if not path.stem.startswith("_")}
    assert packages | top == listed, (sorted((packages | top) - listed), sorted(listed - packages - top))
