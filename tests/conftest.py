"""Shared fixtures. Tests marked `gpu` skip cleanly where no device is usable;
the device is asked about once, when the first such test runs, never at import."""
import functools
import zlib

import numpy as np
import pytest


@functools.cache
def _gpu_reason() -> str | None:
    try:
        from kvcore import gpu
    except ImportError as e:  # the GPU layer itself failed to import
        return f"kvcore.gpu unavailable: {e}"
    return None if gpu.is_available() else "no usable CUDA device (cuda-python, driver or GPU missing)"


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None:
        reason = _gpu_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's id: distinct per test and the same
    in every run (a CRC, not hash(), which Python salts per process)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
