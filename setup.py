"""The one compiled module, ``buffers._groupscan`` (everything else is in pyproject.toml).

Optional: where it cannot be built (no C compiler), the install still succeeds and the broker
checks groups with numpy and the header in Python instead (``buffers.group_check``): its
Python time per 1k-token group is then about twice the compiled path's. ``make test`` fails on
that (tests/buffers/test_group_check.py), so CI never measures the fallback by mistake. Built
against the stable ABI on Python 3.11+ (one ``abi3`` file for every later Python); 3.10's
stable ABI has no buffer protocol, so there it is version-specific.
"""

import sys

from setuptools import Extension, setup

LIMITED = sys.version_info >= (3, 11)

setup(ext_modules=[Extension(
    "buffers._groupscan", ["buffers/_groupscan.c"], optional=True,
    py_limited_api=LIMITED, define_macros=[("Py_LIMITED_API", "0x030B0000")] if LIMITED else [],
    extra_compile_args=[] if sys.platform == "win32" else ["-O3"],
)])
