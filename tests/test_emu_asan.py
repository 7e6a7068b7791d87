"""The AddressSanitizer + UBSan build of the emulated kernels, in every test run: a fast
subset of the gpu tests (the append encoders, the int8 and q8_0 decode kernels, contiguous
and paged, the paged append, the GPU pool's three tiers under a hostile sequence of calls) runs
clean under it, and an overrun of shared and of device memory is reported with its
source line (`tools/emu_asan.py --self-check`). `python3 tools/emu_asan.py` runs every gpu
test that way."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "emu_asan.py")

pytestmark = [pytest.mark.gpu, pytest.mark.emu]


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(autouse=True)
def _emulated_only(request):
    if request.config.getoption("--gpu") == "off":
        pytest.skip("--gpu=off")


def test_the_sanitizer_reports_shared_and_device_memory_overruns():
    res = _tool("--self-check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "shared memory overrun: reported" in res.stdout
    assert "global memory overrun: reported" in res.stdout


@pytest.mark.child([sys.executable, TOOL, "tests/test_emu_kernels.py", "tests/test_gpu_pool.py",
                    "tests/test_gpu_tiers.py", "-q", "-x", "-p", "no:cacheprovider", "-k",
                    "kv_append or append_fork_truncate or hostile_sequence or "
                    "((against_float64 or full_slots or equals_cpu_pool) and (int8 or q8_0))"])
def test_kernels_are_clean_under_the_sanitizer(child):
    out = child.stdout + child.stderr
    assert child.returncode == 0, out[-6000:]
    assert "ERROR: AddressSanitizer" not in out and "runtime error:" not in out
    assert " passed" in out and " failed" not in out
