"""Suite-wide hygiene."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests import ranks


def pytest_configure(config: pytest.Config) -> None:
    ranks.configure()  # before any test starts multiprocessing's fork server


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
    """Long files first, for ``make test``'s pytest-xdist workers (``--dist loadfile
    --no-loadscope-reorder``: a file at a time per worker, in this order).

    First the files with a ``slow`` test (whole runs of 30-90 s), then those with a
    module-scoped fixture (a Ray cluster, the DeepSpeed comparison runs, a vLLM server),
    then the rest, each file's tests together and in order: the short files then fill the
    end of the run on every worker, where one worker's last long file would otherwise leave
    a core idle."""
    slow = {_file(item) for item in items if item.get_closest_marker("slow")}
    fixtures = {_file(item) for item in items if _uses_module_fixture(item)}
    items.sort(key=lambda item: (_file(item) not in slow, _file(item) not in fixtures))


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)  # pytest's own, not public API
    if info is None:
        return False
    return any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values())
