"""The top-level packages import each other in layers, with no cycle.

    entry (the asyncrl modules listed in ENTRY)   may import anything
    learners        rollouters                    core and buffers; never each other
    buffers                                       core
    core (every other asyncrl module)             core only

Every import counts: module level, inside functions, under ``if TYPE_CHECKING``, relative
ones resolved. What both learners and rollouters need lives in the core (the weight sync in
``asyncrl.weights``, the control-plane protocol, devices and ports); what joins them (a
learner's evaluator built from the rollouters' code) is done by the entry layer, which
nothing else may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("asyncrl", "buffers", "learners", "rollouters")

# The composition roots: each may import every package, and no module outside this list may
# import one of them.
ENTRY = {
    "asyncrl.cli": "the command line: dispatches to every role",
    "asyncrl.launch": "`asyncrl up` (local and Ray), each role's process, preflight checks: "
                      "starts the buffer, learner and rollout roles and wires them together",
    "asyncrl.monitor": "the live view: reads the buffer's status keys",
    "asyncrl.eval_checkpoint": "`asyncrl eval`: a learner checkpoint scored by rollouters",
}

ALLOWED = {
    "core": {"core"},
    "buffers": {"core", "buffers"},
    "learners": {"core", "buffers", "learners"},
    "rollouters": {"core", "buffers", "rollouters"},
    "entry": {"core", "buffers", "learners", "rollouters", "entry"},
}


def _modules() -> dict[str, Path]:
    """Every module of the four packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str | None:
    """The layer of a module of ours (None: not ours, e.g. torch). A name inside an entry
    module (``asyncrl.launch.roles.run_learner``) is in the entry layer too."""
    top = module.split(".")[0]
    if top not in PACKAGES:
        return None
    if top != "asyncrl":
        return top
    return "entry" if any(module == e or module.startswith(e + ".") for e in ENTRY) else "core"


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import in the file, in source order, relative
    ones resolved; for ``from package import name`` the submodule ``package.name`` when there
    is one."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add((node.lineno, sub if sub in MODULES else base))
    return sorted(found)


def test_the_packages_import_each_other_in_layers() -> None:
    wrong = []
    for module, path in MODULES.items():
        layer = _layer(module)
        for line, imported in _imports(module, path):
            target = _layer(imported)
            if target is not None and target not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} ({layer}) imports "
                             f"{imported} ({target}); {layer} may import "
                             f"{', '.join(sorted(ALLOWED[layer]))}")
    assert not wrong, "imports across the layers:\n" + "\n".join(wrong)


def test_the_entry_list_names_modules_that_exist() -> None:
    """A stale entry would let a module of that name import anything unnoticed."""
    assert sorted(e for e in ENTRY if e not in MODULES) == []


def test_the_layers_have_no_cycle() -> None:
    """The allowed imports between layers form a DAG, so code that obeys them has no cycle
    between the packages: order the layers so that each imports only those before it."""
    order: list[str] = []
    pending = {layer: allowed - {layer} for layer, allowed in ALLOWED.items()}
    while pending:
        ready = [layer for layer, needs in pending.items() if needs <= set(order)]
        assert ready, f"a cycle among {sorted(pending)}"
        order += sorted(ready)
        for layer in ready:
            del pending[layer]
    assert order[0] == "core" and order[-1] == "entry"


def test_the_walk_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The walker finds function-level, TYPE_CHECKING and relative imports, and resolves a
    relative one against the package (``__init__``) or the module's parent."""
    source = ("from __future__ import annotations\n"
              "from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from learners.loop import run_learner_rank\n"
              "def f():\n    import rollouters.eval\n"
              "from . import worker\nfrom ..buffers import protocol\nfrom .engines import base\n")
    path = tmp_path / "mod.py"
    path.write_text(source)
    found = [name for _, name in _imports("rollouters.fake", path)]
    assert found == ["__future__", "typing", "learners.loop", "rollouters.eval",
                     "rollouters.worker", "buffers.protocol", "rollouters.engines.base"]
    init = tmp_path / "__init__.py"
    init.write_text("from .base import Engine\n")
    assert [name for _, name in _imports("rollouters.engines", init)] == \
        ["rollouters.engines.base"]
