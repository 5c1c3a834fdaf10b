"""Layers of ``oases_ds`` import downwards only.

Why a test: a folder loop (``models`` importing ``runtime`` for the Communicator
while ``runtime`` imports ``models``) builds and runs fine until the day one
import order breaks; reading the imports with ``ast`` catches it at once, with no
process started and nothing imported.

Layers, low to high (a module may import from its own layer and any lower one)::

    utils     oases_ds/utils/* (atomic file writes: plain Python any layer may use; imports
              nothing of ours)
    parallel  oases_ds/parallel/*, launcher.py (starts rank processes; of ours it imports only
              parallel/flight, to read the ranks' records; the planner's profiler and the CLIs use it)
    models    oases_ds/models/*, hf.py (Hugging Face configs and weights in and out of an
              OperatorModel; it reads an engine only through its ``module`` attribute)
    schedule  oases_ds/schedule/*
    runtime   oases_ds/runtime/*, data/* (token batches a training step eats and the corpus
              tokenisation behind them; imports only utils, so the planner may measure on real data)
    config    config.py: the typed "oases" section; needs schedule names and LinkModel,
              is read by the engine, initialize() and the CLIs, never by the planner --
              so it sits between runtime and planner
    planner   oases_ds/planner/*
    engine    engine.py, checkpoint/* (meta, tags, safe loading, the layout-free portable state: the
              engine saves and loads through it; and what oases-ckpt runs: info, convert, reshard),
              portable.py (the old name of checkpoint/portable), __init__.py (initialize() builds the
              engine),
              _deepspeed_compat.py (DeepSpeed patches applied by initialize())
    bench     oases_ds/bench/* (measurement, calibration, records, reports: the library behind
              oases-bench and oases-plan mode=accuracy; it never imports a CLI)
    cli       oases_ds/cli/* (oases-train, oases-plan, oases-bench and its report, oases-ckpt,
              oases-data: argument handling and dispatch only, tests/unit/test_cli_modules.py)

Every import counts: module level, inside functions (still a dependency, just a
later one) and under ``if TYPE_CHECKING`` (a type the module cannot be described
without).  A new top-level module must be placed in ``TOP_LEVEL`` below; the test
says so rather than guessing.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = "oases_ds"
ROOT = Path(__file__).resolve().parent.parent.parent / PACKAGE

LAYERS = ("utils", "parallel", "models", "schedule", "runtime", "config", "planner", "engine", "bench", "cli")
SUBPACKAGES = {"utils": "utils", "parallel": "parallel", "models": "models", "schedule": "schedule", "runtime": "runtime",
               "data": "runtime", "planner": "planner", "checkpoint": "engine", "bench": "bench", "cli": "cli"}
TOP_LEVEL = {"launcher": "parallel", "hf": "models", "config": "config", "engine": "engine",
             "portable": "engine", "__init__": "engine", "_deepspeed_compat": "engine"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """Layer of a dotted ``oases_ds`` module name (a package stands for its ``__init__``)."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return TOP_LEVEL["__init__"]
    head = parts[1]
    if head in SUBPACKAGES:
        return SUBPACKAGES[head]
    if head not in TOP_LEVEL:
        raise AssertionError(f"{PACKAGE}/{head}.py has no layer: add it to TOP_LEVEL in tests/unit/test_layers.py")
    return TOP_LEVEL[head]


def imported_modules(path: Path, module: str, root: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every ``oases_ds`` import in ``path``, wherever it sits.

    ``from pkg import name`` counts as ``pkg.name`` when that is a module of ours
    (``from oases_ds import engine``) and as ``pkg`` otherwise.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((node.lineno, candidate if _is_module(candidate, root) else base))
    return [(line, name) for line, name in found if name == PACKAGE or name.startswith(PACKAGE + ".")]


def _is_module(dotted: str, root: Path) -> bool:
    path = root.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "configs" not in p.relative_to(ROOT).parts)


def violations(files: list[Path], root: Path = ROOT) -> list[str]:
    """One line per import of a higher layer than the importing module's own."""
    out = []
    for path in files:
        module = module_name(path, root)
        rank = LAYERS.index(layer_of(module))
        for line, target in imported_modules(path, module, root):
            target_layer = layer_of(target)
            if LAYERS.index(target_layer) > rank:
                out.append(f"{path.relative_to(root.parent)}:{line} ({layer_of(module)}) imports {target} "
                           f"({target_layer}, a higher layer)")
    return out


def test_every_module_imports_only_its_own_or_lower_layers() -> None:
    files = modules()
    assert len(files) > 30, f"found only {len(files)} modules under {ROOT}"  # the walk really saw the package
    found = violations(files)
    assert not found, "imports against the layer order " + " < ".join(LAYERS) + ":\n" + "\n".join(found)


def flagged_in(tmp_path: Path, files: dict[str, str]) -> list[str]:
    """The files ``violations`` flags in a throw-away ``oases_ds`` made of ``files``
    (path under the package -> source; each folder gets an empty ``__init__.py``)."""
    pkg = tmp_path / PACKAGE
    for name, source in files.items():
        path = pkg / name
        for folder in [path.parent, *path.parent.parents][: len(path.relative_to(pkg).parts)]:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "__init__.py").touch()
        path.write_text(source)
    return sorted(line.split(":")[0] for line in violations(sorted(pkg.rglob("*.py")), root=pkg))


def test_the_walk_sees_function_level_type_checking_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: an upward import is caught wherever it hides."""
    flagged = flagged_in(tmp_path, {
        "runtime/executor.py": "X = 1\n",
        "planner/plan.py": "X = 1\n",
        "models/at_top.py": "from oases_ds.runtime.executor import X\n",
        "models/in_function.py": "def f():\n    import oases_ds.runtime.executor\n",
        "models/typing_only.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from oases_ds.planner.plan import X\n",
        "models/relative.py": "from ..runtime import executor\n",
        "models/downward.py": "from oases_ds.models import at_top\n",
    })
    assert flagged == [f"{PACKAGE}/models/{name}.py" for name in ("at_top", "in_function", "relative", "typing_only")]


def test_an_unplaced_top_level_module_is_named() -> None:
    with pytest.raises(AssertionError, match=r"oases_ds/brand_new\.py has no layer: add it to TOP_LEVEL"):
        layer_of("oases_ds.brand_new")


def test_bench_sits_below_the_clis(tmp_path: Path) -> None:
    """The benchmark library may not reach up into a CLI; a CLI may call the library."""
    flagged = flagged_in(tmp_path, {
        "cli/common.py": "X = 1\n",
        "bench/measure.py": "from oases_ds.cli.common import X\n",
        "cli/bench.py": "from oases_ds.bench import measure\n",
    })
    assert flagged == [f"{PACKAGE}/bench/measure.py"]


def test_benchmark_scripts_use_the_library_not_the_clis() -> None:
    """``benchmarks/*.py`` are entry points of their own: they call ``oases_ds.bench`` and the
    layers below, never a CLI module (whose import registers Hydra schemas and parses nothing
    they need)."""
    scripts = sorted((ROOT.parent / "benchmarks").glob("*.py"))
    assert scripts, "no benchmark scripts found"
    found = [f"{path.name}:{line} imports {target}" for path in scripts
             for line, target in imported_modules(path, f"benchmarks.{path.stem}", ROOT)
             if layer_of(target) == "cli"]
    assert not found, "\n".join(found)


# -- the planner is the product: it does not reach the study, and no lazy import hides a circle --------
def lazy_imports(path: Path, module: str, root: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of the ``oases_ds`` imports inside a function body of ``path``: the
    imports that run late, which is how a circle of modules can load at all."""
    tree = ast.parse(path.read_text(), filename=str(path))
    late = {node.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    return [(line, target) for line, target in imported_modules(path, module, root) if line in late]


def import_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the ``oases_ds`` modules it imports, wherever the import sits."""
    return {module_name(path, root): {target for _, target in imported_modules(path, module_name(path, root), root)}
            for path in files}


def lazy_circles(files: list[Path], root: Path = ROOT, inside: str = f"{PACKAGE}.planner") -> list[str]:
    """One line per lazy import in a module under ``inside`` whose target imports that module back,
    directly or through others: the circle the lazy import closes."""
    graph = import_graph(files, root)
    out = []
    for path in files:
        module = module_name(path, root)
        if not (module == inside or module.startswith(inside + ".")):
            continue
        for line, target in lazy_imports(path, module, root):
            seen, todo = {target}, [target]
            while todo:
                for nxt in graph.get(todo.pop(), ()):
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            if module in seen:
                out.append(f"{path.relative_to(root.parent)}:{line} imports {target} lazily, and {target} imports {module} back")
    return out


def test_the_planner_does_not_reach_the_study() -> None:
    """``oases_ds/planner`` is what plans; the cost-model study (``oases_ds.bench``, ``benchmarks/``) scores it.
    So no planner module imports the study or names a path under ``benchmarks/`` (a planner that read
    stored runs would plan differently in a checkout without them)."""
    planner = [path for path in modules() if path.relative_to(ROOT).parts[0] == "planner"]
    assert len(planner) > 10, planner
    found = [f"{path.relative_to(ROOT.parent)}:{line} imports {target}" for path in planner
             for line, target in imported_modules(path, module_name(path, ROOT), ROOT)
             if target == f"{PACKAGE}.bench" or target.startswith(f"{PACKAGE}.bench.")]
    found += [f"{path.relative_to(ROOT.parent)}:{number} names {match.group(0)!r}" for path in planner
              for number, text in enumerate(path.read_text().splitlines(), 1)
              for match in [re.search(r"benchmarks/\S*", text)] if match]
    assert not found, "\n".join(found)


def test_no_lazy_import_in_the_planner_closes_a_circle() -> None:
    found = lazy_circles(modules())
    assert not found, "\n".join(found)


def test_the_circle_check_sees_a_lazy_import_closing_a_circle(tmp_path: Path) -> None:
    """The checker itself: ``a`` imports ``b`` at the top and ``b`` imports ``a`` in a function (through
    ``c`` also counts); a lazy import that closes no circle (``b`` -> ``d``) is fine."""
    pkg = tmp_path / PACKAGE
    sources = {"planner/a.py": "from oases_ds.planner import b\n",
               "planner/b.py": "def f():\n    from oases_ds.planner import a\n    from oases_ds.planner import d\n",
               "planner/c.py": "def g():\n    import oases_ds.planner.e\n",
               "planner/d.py": "X = 1\n",
               "planner/e.py": "from oases_ds.planner import c\n"}
    for name, source in sources.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(source)
    for folder in (pkg, pkg / "planner"):
        (folder / "__init__.py").touch()
    found = lazy_circles(sorted(pkg.rglob("*.py")), root=pkg)
    assert [line.split(" imports ")[0] for line in found] == [f"{PACKAGE}/planner/b.py:2", f"{PACKAGE}/planner/c.py:2"]
