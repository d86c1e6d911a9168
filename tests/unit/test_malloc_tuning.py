"""keep_large_buffers: glibc takes the thresholds (in a child, so this process keeps its own)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tests.buffers.conftest import ROOT, child_env


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_thresholds_and_a_second_call_is_harmless():
    code = ("from buffers.malloc_tuning import keep_large_buffers as k; "
            "print(k(), k())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["True", "True"]
