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
    """``make test`` runs the suite on pytest-xdist workers (``--dist loadgroup``). A test
    that uses a module-scoped fixture joins its module's group, so that fixture (a local Ray
    cluster, the 9-process DeepSpeed comparison, a vLLM server) is built on one worker, once,
    instead of once on every worker that happens to get one of the module's tests. The other
    tests go to whichever worker is free."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # pytest's, not public: no info, no group
        if info is None:
            continue
        if any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
