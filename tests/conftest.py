"""Suite-wide hygiene."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """A test that runs ``asyncrl.cli.main`` in-process gets its logging set up as a role's
    (``logging.basicConfig(stream=sys.stderr, force=True)``), bound to the stderr pytest
    captured for that test and closed after it: later tests' log records then failed with
    "I/O operation on closed file" tracebacks on their own stderr. Put the root logger back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """For ``make test``'s pytest-xdist workers (``--dist loadgroup``):

    - A test that uses a module-scoped fixture joins its module's group, so that fixture (a
      local Ray cluster, the 9-process DeepSpeed comparison, a vLLM server) is built on one
      worker, once, instead of on every worker that happens to get one of the module's tests.
    - Modules with a ``slow`` test (whole runs of 30-90 s) come first, each module's tests kept
      together and in order: the short tests then fill the end of the run on both workers,
      where one worker's last long run would otherwise leave the other core idle."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # pytest's, not public: no info, no group
        if info is None:
            continue
        if any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(_module(item)))
    slow = {_module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _module(item) not in slow)  # stable


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]
