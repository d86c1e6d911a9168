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
