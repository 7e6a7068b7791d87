"""tools/gpu_check.py's failure paths, in its dry run (--emulate): a collection error, a
failing test and a test past --test-timeout are each named under the summary table; a
stage past its limit is a TIMEOUT and a later one that cannot start is SKIPPED with the
reason; logs stay few and bounded; --gpu=device never emulates. Its kernels stage
(tools/gpu_kernels_check.py) passes wherever the gpu tests run."""
import os
import subprocess
import sys

import pytest

from kvcore.gpu._emu import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

needs_emulator = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler (g++) on PATH")

INJECTED = """
import time
import pytest
pytestmark = pytest.mark.gpu
def test_fails():
    assert 1 == 2, "injected failure"
def test_hangs():
    time.sleep(60)
"""


def _check(tmp_path, *args):
    """gpu_check.sh --emulate ARGS with the project's conftest as a plugin (the injected tests
    live outside tests/): (exit status, summary lines by stage, other summary lines)."""
    (tmp_path / "test_injected.py").write_text(INJECTED)
    (tmp_path / "test_broken.py").write_text("import not_a_module\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")}
    proc = subprocess.run([os.path.join(ROOT, "tools", "gpu_check.sh"), "--emulate", *args[:-1], str(out),
                           "--", "-p", "conftest", *args[-1]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    text = (out / "summary.txt").read_text()
    assert text in proc.stdout
    assert len(os.listdir(out)) <= 8
    lines = text[text.index("=== gpu_check summary: EMULATED dry run"):].splitlines()
    stages = {line.split()[0]: line for line in lines[2:] if not line.startswith(("  ", "overall"))}
    return proc.returncode, stages, lines


@pytest.mark.emu
@needs_emulator
def test_a_collection_error_a_failure_and_a_hung_test_are_named(tmp_path):
    rc, stages, lines = _check(tmp_path, "--only", "pytest", "--budget", "60",
                               ["--test-timeout=3", str(tmp_path / "test_broken.py"), str(tmp_path / "test_injected.py")])
    assert rc == 1 and lines[-1] == "overall: FAILED"
    assert stages["pytest"].split()[1] == "FAIL" and "2 failed" in stages["pytest"] and "1 error" in stages["pytest"]
    named = [line for line in lines if line.startswith("  pytest: ")]
    assert any(line.startswith("  pytest: ERROR") and "test_broken.py" in line for line in named)
    assert any("test_fails - AssertionError" in line for line in named)
    assert any("test_hangs - conftest.PerTestTimeout" in line for line in named)
    assert "not selected (--only)" in stages["kernels"] and stages["kernels"].split()[1] == "SKIPPED"


@pytest.mark.emu
@needs_emulator
def test_an_exhausted_budget_times_out_a_stage_and_skips_the_next(tmp_path):
    rc, stages, lines = _check(tmp_path, "--only", "pytest,kernels", "--budget", "14",
                               [str(tmp_path / "test_injected.py") + "::test_hangs"])
    assert rc == 1 and lines[-1] == "overall: FAILED"
    assert stages["pytest"].split()[1] == "TIMEOUT" and "test_hangs" in stages["pytest"]
    assert stages["kernels"].split()[1] == "SKIPPED" and "no time left" in stages["kernels"]
    assert "14 s budget" in lines[0]


@pytest.mark.gpu
def test_the_kernels_stage_passes(capsys):
    import gpu_kernels_check
    assert gpu_kernels_check.main(["--small", "--formats", "int8,q8_0"]) == 0
    assert "gpu_kernels_check: 5 passed, 0 failed" in capsys.readouterr().out


def test_on_a_device_jit_runs_while_the_build_does(tmp_path):
    import time

    import gpu_check
    nap = [sys.executable, "-c", "import time; time.sleep(1.5); print('done')"]
    chosen = [gpu_check.Stage(name, f"{name}.log", nap, 30, 0, "done") for name in ("build", "jit", "pytest")]
    chosen[2].argv, chosen[2].why = None, "not selected (--only)"
    t0 = time.monotonic()
    results = gpu_check.run_stages(chosen, str(tmp_path), t0 + 60, 1.0, overlap=True)
    assert [(r.name, r.status) for r in results] == [("build", "PASS"), ("jit", "PASS"), ("pytest", "SKIPPED")]
    assert time.monotonic() - t0 < 2.9       # one nap's time, not two
    t0 = time.monotonic()
    gpu_check.run_stages(chosen, str(tmp_path), t0 + 60, 1.0, overlap=False)
    assert time.monotonic() - t0 >= 3.0


def test_a_log_keeps_its_head_and_tail(tmp_path, monkeypatch):
    import gpu_check
    monkeypatch.setattr(gpu_check, "HEAD_BYTES", 100)
    monkeypatch.setattr(gpu_check, "TAIL_BYTES", 50)
    log = gpu_check._Log(str(tmp_path / "x.log"))
    for i in range(100):
        log.write(f"line {i:03d}\n".encode())
    log.close()
    text = (tmp_path / "x.log").read_text()
    assert text.startswith("line 000\n") and text.endswith("line 099\n")
    assert "bytes of output dropped here" in text and len(text) < 250


@pytest.mark.emu
def test_a_device_run_never_emulates():
    # without a device, --gpu=device stops before the first test: it never falls back to the
    # emulator (on a device, the emulator's own tests skip there: conftest.py)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--gpu=device",
                           "tests/test_gpu_graph.py::test_stale_graph_refuses"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out
    assert "--gpu=device, but no usable CUDA device (cuda-python, driver or GPU missing): stopped " \
           "before any test ran" in out
    assert " passed" not in out and "gpu: emu" not in out
