"""kvcore as a user installs it: the sdist and the wheel (tools/check_dist.py, beside the
suite), and the CPU check that refuses a build for instructions this CPU lacks."""
import os
import re
import subprocess
import sys

import pytest

from kvcore import _cache, _cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the names of __builtin_cpu_supports that setup.py records, as /proc/cpuinfo spells them
CPUINFO = {"sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
           "bmi": "bmi1", "bmi2": "bmi2", "avx512f": "avx512f", "avx512bw": "avx512bw",
           "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512cd": "avx512cd",
           "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16"}


def _cpuinfo_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(ln for ln in f if ln.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return set(line.split(":", 1)[1].split())


def test_the_recorded_target_is_what_the_kernels_were_compiled_for():
    """kvcore._cpu (compiled for the baseline) names the features of the kernels' target;
    the kernels' own build_info (their predefined macros) agrees."""
    isa = set(_cache.build_info()["isa"])
    target = _cpu.target()
    for macro_name, name in (("AVX2", "avx2"), ("FMA", "fma"), ("F16C", "f16c"),
                             ("AVX512F", "avx512f"), ("SSE4.2", "sse4.2")):
        assert (macro_name in isa) == (name in target), (macro_name, isa, target)


def test_the_cpu_check_asks_the_cpu_about_each_feature(monkeypatch):
    """missing() agrees with the kernel's /proc/cpuinfo for every feature setup.py may
    record: present ones pass, absent ones are named."""
    flags = _cpuinfo_flags()
    if flags is None or not _cpu.target():
        pytest.skip("no /proc/cpuinfo flags, or a target with no x86 features (not x86)")
    for name, flag in CPUINFO.items():
        monkeypatch.setattr(_cpu, "target", lambda name=name: [name])
        assert _cpu.missing() == ([] if flag in flags else [name]), name
    monkeypatch.setattr(_cpu, "target", lambda: ["avx2", "no-such-feature"])
    assert _cpu.missing() == ([] if "avx2" in flags else ["avx2"])   # unknown: not refused


def test_this_cpu_runs_this_build_and_a_lacking_one_is_refused(monkeypatch):
    assert _cpu.missing() == []
    _cpu.check()
    monkeypatch.setattr(_cpu, "missing", lambda: ["avx512f", "avx512bw"])
    with pytest.raises(ImportError, match=r"this CPU lacks avx512f avx512bw: .*illegal "
                                          r"instruction.*KVCORE_MARCH=x86-64-v3"):
        _cpu.check()


def test_an_unbuilt_tree_says_so_at_import(tmp_path):
    """A copy of the package without its compiled extensions (an sdist's tree before the
    build) fails at import with a message that says what to do, not a circular import."""
    pkg = tmp_path / "kvcore"
    pkg.mkdir()
    src = os.path.join(ROOT, "kvcore")
    for name in os.listdir(src):
        if name.endswith(".py"):
            (pkg / name).write_bytes(open(os.path.join(src, name), "rb").read())
    # -S: no site-packages, so no installed kvcore (an editable install finds submodules
    # by name) can stand in for the missing extensions
    run = subprocess.run([sys.executable, "-S", "-c", "import kvcore"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert "kvcore's compiled extensions are missing" in run.stderr
    assert "pip install -e ." in run.stderr and "circular import" not in run.stderr


def test_setup_refuses_a_tree_without_the_cython_sources(tmp_path):
    """setup.py in a tree that lacks kvcore/_*.pyx fails loudly instead of building a wheel
    with no extension."""
    (tmp_path / "kvcore").mkdir()
    (tmp_path / "kvcore" / "__init__.py").write_text("")
    for name in ("setup.py", "pyproject.toml"):
        (tmp_path / name).write_bytes(open(os.path.join(ROOT, name), "rb").read())
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_ext"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "kvcore/_cache.pyx not found" in run.stderr and "Cython sources" in run.stderr


@pytest.mark.slow
@pytest.mark.child([sys.executable, os.path.join(ROOT, "tools", "check_dist.py")])
def test_the_sdist_and_wheel_install_and_run_in_a_new_venv(child):
    """tools/check_dist.py: the sdist holds the build's sources, the wheel built from it
    (in an isolated build environment, as `pip install` of the sdist builds it: one
    compilation proves the sdist builds and the wheel installs) holds every extension and
    every CUDA file setup.py ships, and is tagged for this platform; in a new venv the
    wheel imports, runs `python -m kvcore demo --quick` and the sdist's tests."""
    out = child.stdout + child.stderr
    assert child.returncode == 0, out[-6000:]
    exts = " ".join(sorted(f[:-4] for f in os.listdir(os.path.join(ROOT, "kvcore"))
                           if f.startswith("_") and f.endswith(".pyx")))
    assert re.search(r"wheel: kvcore-[\w.]+-cp\d+-cp\d+-\w+\.whl, extensions " + exts
                     + r", [1-9]\d* PTX files, \d+ files under kvcore/_cuda/", out), out
    assert "python -m build (sdist, then the wheel from it): ok" in out
    assert "pip install the wheel built from the sdist: ok" in out
    assert "python -m kvcore demo --quick: ok" in out and "dist check passed" in out
    assert re.search(r"\n\d+ passed", out), out
