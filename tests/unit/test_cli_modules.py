"""A CLI module parses arguments, dispatches to the library and prints: it defines no library code.

Why a test: library code written into a CLI module (``oases-ckpt`` once held the whole
Hugging Face conversion and the reshard launcher) can only be reached through the command
line, is tested through subprocesses, and is copied when a second caller needs it.  Reading
the CLI modules with ``ast`` states what may live there, with nothing imported.

The rule, for every module under ``oases_ds/cli/``:

* **Its classes are Hydra schemas only**: ``@dataclass`` classes named ``...Schema``, which
  declare the arguments Hydra parses.  Any other class (a layout, a result type, an error) is a
  type of the library's.
* **Each of its functions is called from a CLI entry point**: reachable by direct calls
  (``f(...)``, or ``module.f(...)`` on another CLI module) from a ``main``, ``entry`` or
  ``parser`` of a CLI module, or from code that runs when a CLI module is imported (building
  a schema).  A function only handed elsewhere -- a rank body passed to ``launch``, run in
  another process -- or called only by tests or other layers is library code.

What it cannot see: a function that the CLI does call but that does the library's work.
That is a judgement for review; the ``<= 150`` lines of ``cli/ckpt.py`` and the layer order
(``tests/unit/test_layers.py``: nothing below the CLIs may import one) keep it visible.
Known and left: ``cli/train.py``'s ``train_rank`` is the training loop each rank runs (called
by ``main`` under torchrun, so the rule passes it); moving it out needs a typed run
configuration in place of the Hydra dict it reads.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "oases_ds"
CLI = Path(__file__).resolve().parent.parent.parent / PACKAGE / "cli"
ENTRY_POINTS = ("main", "entry", "parser")

Key = tuple[str, str]  # (CLI module name, function name)


def _is_schema(node: ast.ClassDef) -> bool:
    decorated = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
    return decorated and node.name.endswith("Schema")


def _cli_names(tree: ast.Module, package: str) -> dict[str, tuple[str, ...]]:
    """Local name -> ``("module", M)`` for a CLI module imported as a name, ``("function", M, F)``
    for a function imported from CLI module ``M``."""
    names: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module == package:
                    names[alias.asname or alias.name] = ("module", alias.name)
                elif node.module.startswith(package + "."):
                    names[alias.asname or alias.name] = ("function", node.module.rsplit(".", 1)[1], alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(package + ".") and alias.asname:
                    names[alias.asname] = ("module", alias.name.rsplit(".", 1)[1])
    return names


def _calls(module: str, nodes: list[ast.AST], names: dict[str, tuple[str, ...]], defined: set[Key]) -> set[Key]:
    """The CLI functions called in ``nodes`` (of CLI module ``module``)."""
    found: set[Key] = set()
    for root in nodes:
        for node in ast.walk(root):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name):
                if (module, func.id) in defined:
                    found.add((module, func.id))
                elif names.get(func.id, ("",))[0] == "function":
                    found.add(names[func.id][1:])  # type: ignore[arg-type]
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                target = names.get(func.value.id)
                if target is not None and target[0] == "module":
                    found.add((target[1], func.attr))
    return found


def library_code(cli: Path = CLI) -> list[str]:
    """One line per definition in the CLI modules under ``cli`` that breaks the rule (module docstring)."""
    package = f"{PACKAGE}.{cli.name}"
    trees = {path.stem: ast.parse(path.read_text(), filename=str(path)) for path in sorted(cli.glob("*.py"))}
    functions: dict[Key, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    out = []
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[(module, node.name)] = node
            elif isinstance(node, ast.ClassDef) and not _is_schema(node):
                out.append(f"{cli.name}/{module}.py:{node.lineno} defines class {node.name} (not a Hydra schema)")
    defined = set(functions)
    names = {module: _cli_names(tree, package) for module, tree in trees.items()}
    todo: list[Key] = []
    for module, tree in trees.items():  # what runs at import, and the entry points
        at_import = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        at_import += [d for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for d in n.decorator_list]
        todo += _calls(module, at_import, names[module], defined)
        todo += [(module, name) for name in ENTRY_POINTS if (module, name) in defined]
    reached: set[Key] = set()
    while todo:
        key = todo.pop()
        if key in reached or key not in functions:
            continue
        reached.add(key)
        todo += _calls(key[0], [functions[key]], names[key[0]], defined)
    out += [f"{cli.name}/{module}.py:{functions[(module, name)].lineno} defines {name}(), which no CLI entry point "
            "calls (library code, or a rank body handed to launch)" for module, name in sorted(defined - reached)]
    return out


def test_no_cli_module_defines_library_code() -> None:
    assert len(list(CLI.glob("*.py"))) > 5, f"found too few CLI modules under {CLI}"
    found = library_code()
    assert not found, "move these into the library (oases_ds/cli/ parses, dispatches and prints):\n" + "\n".join(found)


def test_cli_ckpt_only_parses_and_dispatches() -> None:
    """Issue 39: ``oases-ckpt`` was 408 lines, most of them the checkpoint library's."""
    lines = len((CLI / "ckpt.py").read_text().splitlines())
    assert lines < 150, f"oases_ds/cli/ckpt.py has {lines} lines"


def test_the_rule_sees_library_classes_rank_bodies_and_uncalled_helpers(tmp_path: Path) -> None:
    """The checker itself, on a throw-away CLI package: schemas, helpers ``main`` calls (here or
    in another CLI module) and what runs at import pass; a class, a rank body handed to
    ``launch`` and a helper nobody calls are named."""
    cli = tmp_path / "cli"
    cli.mkdir()
    (cli / "__init__.py").write_text("")
    (cli / "common.py").write_text("def fail(message):\n    raise SystemExit(message)\n\n"
                                   "def make_schema(name):\n    return name\n")
    (cli / "tool.py").write_text(
        "from dataclasses import dataclass\n"
        "from oases_ds.cli import common\n"
        "from oases_ds.cli.common import make_schema\n"
        "from oases_ds.launcher import launch\n\n"
        "Built = make_schema('Built')\n\n"
        "@dataclass\nclass ToolSchema:\n    steps: int = 1\n\n"
        "@dataclass(frozen=True)\nclass Layout:\n    tp: int\n\n"
        "def rank_body(x):\n    return x\n\n"
        "def helper(args):\n    return args\n\n"
        "def unused():\n    return 1\n\n"
        "def main(argv=None):\n    launch(rank_body, 2)\n    common.fail(helper(argv))\n")
    found = library_code(cli)
    assert [line.split(" defines ")[1].split(" ")[0] for line in found] == ["class", "rank_body(),", "unused(),"], found
    assert found[0] == "cli/tool.py:13 defines class Layout (not a Hydra schema)"
