"""The emulator's host C++ compiler: $CXX when set, else g++ on PATH, found by use_emulator()
itself (not at the first cache), a missing or unrunnable one refused with
GpuUnavailableError naming what was looked for, the emulator left off. CPU only: the
use_emulator() calls run in child processes, so the session's own GPU mode is untouched."""
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from kvcore import KVCacheError
from kvcore.gpu import GpuUnavailableError
from kvcore.gpu._emu import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GXX = shutil.which("g++")


def _use_emulator_in_child(env_changes: dict, after: str = "") -> dict:
    """use_emulator() in a fresh process with `env_changes` (None deletes a variable), then
    `after` if it succeeded; its outcome as {"error": [type, message] or None,
    "emulating": bool, ...what `after` put in `got`}."""
    env = dict(os.environ)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    code = f"""
import json
from kvcore import gpu
got = {{"error": None}}
try:
    gpu.use_emulator()
except Exception as e:
    got["error"] = [type(e).__name__, str(e)]
else:
    exec({after!r})
got["emulating"] = gpu.using_emulator()
print(json.dumps(got))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _bad_cxx(tmp_path):
    """(CXX value, why it is refused) for each way a CXX can name no runnable compiler."""
    not_executable = tmp_path / "not-executable-g++"
    not_executable.write_text("#!/bin/sh\nexec g++ \"$@\"\n")
    failing = _script(tmp_path / "failing-cxx", "echo 'this compiler is broken' >&2\nexit 3\n")
    return [
        (str(tmp_path / "no" / "such" / "g++"), "no such file"),
        (str(not_executable), "the file is not executable"),
        ("kvcore-no-such-compiler", "no kvcore-no-such-compiler on PATH"),
        (failing, "exited 3: this compiler is broken"),
    ]


def test_a_cxx_naming_no_runnable_compiler_is_refused_by_use_emulator(tmp_path, monkeypatch):
    for value, why in _bad_cxx(tmp_path):
        monkeypatch.setenv("CXX", value)
        assert kernels.compiler() is None, value
        with pytest.raises(GpuUnavailableError) as e:
            kernels.find_compiler()
        message = str(e.value)
        assert message.startswith(f"CXX={value!r} names no runnable C++ compiler: "), message
        assert message.endswith(f"{why}; set CXX to a working C++ compiler, or unset it to use "
                                f"g++ from PATH"), message
        assert isinstance(e.value, KVCacheError) and isinstance(e.value, ImportError)
        # refused at once, by use_emulator itself; the emulator stays off
        got = _use_emulator_in_child({"CXX": value})
        assert got == {"error": ["GpuUnavailableError", message], "emulating": False}, value


def test_no_compiler_on_path_is_refused_by_use_emulator(tmp_path, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(empty))
    assert kernels.compiler() is None and not kernels.available()
    expected = ("the GPU emulator needs a host C++ compiler: CXX is not set and there is no g++ "
                "on PATH; install g++ (Debian/Ubuntu: apt-get install g++), or set CXX to the "
                "C++17 compiler to use (a name on PATH or a path)")
    # refused at once, by use_emulator itself; the emulator stays off
    got = _use_emulator_in_child({"CXX": None, "PATH": str(empty)})
    assert got == {"error": ["GpuUnavailableError", expected], "emulating": False}
    with pytest.raises(GpuUnavailableError) as e:
        kernels.find_compiler()
    assert str(e.value) == expected
    with pytest.raises(GpuUnavailableError, match="CXX is not set and there is no g"):
        kernels._build("rope", kernels.default_source_dir(), False)
    # an empty CXX counts as unset
    monkeypatch.setenv("CXX", "")
    with pytest.raises(GpuUnavailableError, match="CXX is not set"):
        kernels.find_compiler()


@pytest.mark.skipif(GXX is None, reason="no g++ on PATH")
def test_the_compiler_cxx_names_builds_the_kernels(tmp_path, monkeypatch):
    """A CXX wrapper that records its calls and runs g++: use_emulator() takes it, the
    kernels of a new cache are compiled by it, and its builds are cached apart from g++'s
    (the compiler's command is part of the cache key)."""
    log = tmp_path / "calls.log"
    wrapper = _script(tmp_path / "my-cxx", f'echo "$@" >> "{log}"\nexec "{GXX}" "$@"\n')
    cache = tmp_path / "cache"
    monkeypatch.setenv("CXX", wrapper)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert kernels.compiler() == wrapper and kernels.find_compiler() == (wrapper,)

    got = _use_emulator_in_child({"CXX": wrapper, "XDG_CACHE_HOME": str(cache)}, after="""
from kvcore import KVSpec
from kvcore.gpu._emu import kernels
got["compiler"] = kernels.compiler()
c = gpu.GpuKVCache(KVSpec(num_layers=1, num_kv_heads=1, head_dim=32, capacity=8), 1)
got["lengths"] = c.lengths_host().tolist()
c.free()
""")
    assert got == {"error": None, "compiler": wrapper, "lengths": [0], "emulating": True}
    builds = [line for line in log.read_text().splitlines() if "module.cpp" in line]
    assert len(builds) == 1 and '-DKVEMU_SOURCE="kv_append.cu"' in builds[0], log.read_text()
    stubs = [line for line in log.read_text().splitlines() if "libcuda.cpp" in line]
    assert len(stubs) == 1 and "-Wl,-soname,libcuda.so.1" in stubs[0]   # the emulated libcuda
    by_wrapper = sorted(os.listdir(cache / "kvcore" / "emu"))
    assert len(by_wrapper) == 2 and by_wrapper[0].startswith("kv_append-")
    assert by_wrapper[1].startswith("libcuda-")

    # g++ itself (same version line) does not reuse the wrapper's build
    monkeypatch.delenv("CXX")
    assert kernels.compiler() == GXX
    built = kernels._build("kv_append", kernels.default_source_dir(), False)
    assert os.path.basename(built) not in by_wrapper
    assert len([line for line in log.read_text().splitlines() if "module.cpp" in line]) == 1


@pytest.mark.skipif(GXX is None, reason="no g++ on PATH")
def test_cxx_may_be_a_command_with_arguments(tmp_path, monkeypatch):
    """CXX is split as a shell would ("ccache g++"): its first word is resolved on PATH."""
    monkeypatch.setenv("CXX", "g++ -Wno-unused-variable")
    assert kernels.find_compiler() == (GXX, "-Wno-unused-variable")
    assert kernels.compiler() == f"{GXX} -Wno-unused-variable"
    monkeypatch.setenv("CXX", "g++ 'unclosed")
    with pytest.raises(GpuUnavailableError, match=r"CXX=\"g\+\+ 'unclosed\" is not a command"):
        kernels.find_compiler()
