"""The GPU layer under two generations of cuda-python's bindings: the suite runs every gpu
test under the installed one (13.x, the `[test]` extra), and this file runs the driver's
own tests, the cache tests and the pool's prefix-cache tests (a captured graph among them)
under the oldest the `[cuda]` extra allows (tools/bindings_check.py installs it beside, for
a child pytest only); `python3 tools/bindings_check.py -m gpu` runs every gpu test so."""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "bindings_check.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bindings_check  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.emu]


def test_the_pin_names_the_release_the_check_installs():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pins = re.findall(r'"cuda-bindings>=([\d.]+),<(\d+)"', f.read())
    assert pins and all(p == pins[0] for p in pins), pins   # [cuda] and [test] agree
    low, below = pins[0]
    assert bindings_check.OLDEST.startswith(low + ".") or bindings_check.OLDEST == low
    import cuda.bindings
    major, minor = (int(x) for x in cuda.bindings.__version__.split(".")[:2])
    assert (int(low.split(".")[0]), int(low.split(".")[1])) <= (major, minor) and major < int(below)


@pytest.mark.child([sys.executable, TOOL, "tests/test_emu_driver.py", "tests/test_gpu_cache.py",
                    "tests/test_gpu_prefix.py", "-q", "-p", "no:cacheprovider"])
def test_the_oldest_bindings_the_pin_allows(child):
    out = child.stdout + child.stderr
    assert child.returncode == 0, out[-6000:]
    assert f"cuda-bindings {bindings_check.OLDEST} (from " in out
    assert " passed" in out and " failed" not in out and " error" not in out
