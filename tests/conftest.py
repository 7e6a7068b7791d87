"""Shared fixtures, and where `gpu`-marked tests run (`--gpu`, printed in the header):

  auto    a real device when cuda-python finds one, else the emulator (kvcore.gpu.use_emulator)
          when a C++ compiler exists, else off (the default)
  device  a real device; gpu tests fail without one
  emu     the emulator: kvcore's CUDA kernels compiled for the CPU, the emulated driver
  off     gpu tests skip

The choice is made once, at session start; the device is asked about then, never at import.
A device run never emulates: `emu`-marked tests (of the emulator itself) skip there, and a
test that switched kvcore to the emulator stops the run.
Under the emulator, every gpu test must leave nothing live that it created (device memory,
streams, events, graphs), checked after its teardown; `device`-marked tests need third-party
CUDA arrays (torch, CuPy) and a real device, and skip under the emulator.
"""
import faulthandler
import functools
import gc
import os
import signal
import subprocess
import zlib

import numpy as np
import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_addoption(parser):
    parser.addoption("--gpu", choices=("auto", "device", "emu", "off"), default="auto",
                     help="where gpu-marked tests run: a real device, the CPU emulator, or off "
                          "(auto: a device when usable, else the emulator)")
    parser.addoption("--gpu-seed", type=int, default=0,
                     help="seed of the emulator's thread shuffling (use_emulator(seed=...))")
    parser.addoption("--test-timeout", type=int, default=0,
                     help="fail a test (setup, call and teardown) running past this many seconds, "
                          "by SIGALRM; every thread's stack is dumped 5 s later if it is stuck in C "
                          "(pytest-timeout is not on the GPU image); 0: no limit")


class PerTestTimeout(Exception):
    """A test ran past --test-timeout."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = item.config.getoption("--test-timeout")
    if not limit:
        yield
        return

    def alarm(signum, frame):
        raise PerTestTimeout(f"{item.nodeid} ran past --test-timeout={limit} s")
    previous = signal.signal(signal.SIGALRM, alarm)
    faulthandler.dump_traceback_later(limit + 5)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@functools.cache
def _real_device() -> bool:
    from kvcore import gpu
    return not gpu.using_emulator() and gpu.is_available()


def _compiler() -> str | None:
    from kvcore.gpu._emu import kernels
    return kernels.compiler()


@functools.cache
def _mode(option: str) -> tuple[str, str | None]:
    """(mode, reason): mode "device", "emu" or "off"; the reason gpu tests cannot run."""
    if option in ("auto", "device") and _real_device():
        return "device", None
    if option == "device":
        return "device", "--gpu=device, but no usable CUDA device (cuda-python, driver or GPU missing)"
    if option in ("auto", "emu") and _compiler():
        return "emu", None
    if option == "off":
        return "off", "--gpu=off"
    return "off", "no usable CUDA device and no C++ compiler for the emulator"


# ------------------------------------------------------------------ child checks
# Tests marked child(argv) check the answer of a child process that runs for minutes on
# one core (nvcc and ptxas over every kernel; the sanitizer build of the emulated
# kernels). The suite runs on one core, so each child starts as soon as collection has
# selected its test (and nothing marks it skipped), beside the rest of the suite; its
# test runs last and waits for the answer (the `child` fixture).
_CHILDREN = pytest.StashKey[dict]()


def _emulator_test_in_device_run(item) -> bool:
    """An `emu`-marked test (of the emulator itself) in a device run: it skips."""
    return item.get_closest_marker("emu") is not None and _mode(item.config.getoption("--gpu"))[0] == "device"


def _runnable(item) -> bool:
    """False when a skipif mark, or the gpu mode, will skip the item."""
    if any(m.args and m.args[0] for m in item.iter_markers("skipif")):
        return False
    if _emulator_test_in_device_run(item):
        return False
    return item.get_closest_marker("gpu") is None or _mode(item.config.getoption("--gpu"))[1] is None


def _spawn(argv: list[str]) -> subprocess.Popen:
    """argv in a process group of its own (killed whole: nvcc, ptxas, pytest children)."""
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


@pytest.hookimpl(trylast=True)   # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    if _mode(config.getoption("--gpu"))[0] == "emu":
        # device-marked tests need torch/CuPy CUDA arrays, which no emulator can make:
        # deselected (and counted in the header), so an emulated gpu run skips nothing
        device = [i for i in items if i.get_closest_marker("device") is not None]
        if device:
            config.hook.pytest_deselected(items=device)
            items[:] = [i for i in items if i.get_closest_marker("device") is None]
    children = [i for i in items if i.get_closest_marker("child") is not None]
    config.stash[_CHILDREN] = {i.nodeid: _spawn(i.get_closest_marker("child").args[0])
                               for i in children if _runnable(i)}
    items[:] = [i for i in items if i.get_closest_marker("child") is None] + children


def pytest_unconfigure(config):   # an interrupted or stopped (-x) run leaves none running
    for proc in config.stash.get(_CHILDREN, {}).values():
        _kill(proc)


@pytest.fixture
def child(request):
    """The finished child process of the test's child(argv) mark (started at collection,
    or now): subprocess.CompletedProcess with text stdout and stderr."""
    argv = request.node.get_closest_marker("child").args[0]
    children = request.config.stash.setdefault(_CHILDREN, {})
    proc = children.setdefault(request.node.nodeid, None) or _spawn(argv)
    children[request.node.nodeid] = proc
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        _kill(proc)
        pytest.fail(f"{' '.join(argv)} ran past 900 s", pytrace=False)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def pytest_report_header(config):
    mode, reason = _mode(config.getoption("--gpu"))
    if mode == "emu":
        return (f"gpu: emu (kvcore.gpu.use_emulator: CPU kernels built by {_compiler()}, "
                f"seed {config.getoption('--gpu-seed')}; tests marked device, which need "
                f"torch/CuPy CUDA arrays, deselected)")
    if mode == "device" and reason is None:
        from kvcore import gpu
        ctx = gpu.Context.get()
        return f"gpu: device ({ctx.name}, cc {ctx.compute_capability[0]}.{ctx.compute_capability[1]})"
    return f"gpu: {mode} ({reason})"


def pytest_sessionstart(session):
    mode, reason = _mode(session.config.getoption("--gpu"))
    if mode == "device" and reason is not None:   # a device run never falls back to the emulator
        pytest.exit(f"{reason}: stopped before any test ran", returncode=4)


_emulator_started = False
_LEAK_MARK = pytest.StashKey[int]()


def _start_emulator(config) -> None:
    """use_emulator once per session, and every emulated kernel module built up front."""
    global _emulator_started
    if not _emulator_started:
        from kvcore import gpu
        from kvcore.gpu._emu import kernels
        gpu.use_emulator(seed=config.getoption("--gpu-seed"))
        kernels.build_all()
        _emulator_started = True


def pytest_runtest_setup(item):
    if _emulator_test_in_device_run(item):
        pytest.skip("tests the CPU emulator: not part of a device run")
    if item.get_closest_marker("gpu") is None:
        return
    mode, reason = _mode(item.config.getoption("--gpu"))
    if reason is not None:
        if mode == "device":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    if mode == "emu":
        _start_emulator(item.config)
        from kvcore.gpu._emu import driver as emu
        item.stash[_LEAK_MARK] = emu.live_serial()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and not report.passed:
        item.stash[_LEAK_MARK] = None  # a failed test's leftovers are not reported twice
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if item.get_closest_marker("gpu") is not None and _mode(item.config.getoption("--gpu")) == ("device", None):
        from kvcore import gpu
        if gpu.using_emulator():
            pytest.exit(f"{item.nodeid} switched kvcore to the emulator in a device run: "
                        f"stopped, since every later result would be emulated", returncode=3)
    serial = item.stash.get(_LEAK_MARK, None)
    if serial is None:
        return result
    from kvcore import gpu
    from kvcore.gpu._emu import driver as emu
    gc.collect()
    # kvcore's per-context cache (the event order_after reuses) belongs to no test
    cached = {int(c.order_event._handle) for c in gpu.Context._contexts.values()
              if c.order_event is not None and c.order_event._handle is not None}
    leaked = [x for x in emu.leaks_since(serial) if x.handle not in cached]
    if leaked:
        lines = "\n  ".join(str(x) for x in leaked)
        pytest.fail(f"the test left {len(leaked)} emulated GPU resource(s) live:\n  {lines}",
                    pytrace=False)
    return result


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's id: distinct per test and the same
    in every run (a CRC, not hash(), which Python salts per process)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


# ------------------------------------------------------------------ Redis servers
# Tests that need a server take these fixtures. In CI (CI=true) a server that cannot be
# started fails them; elsewhere a machine without redis-server skips them, saying so.

def _server_binaries():
    from _servers import binaries
    found = binaries()
    if found is None:
        reason = ("no redis-server (or valkey-server) on PATH: the README's test command "
                  "installs Debian's redis-server package")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One redis-server for the session: Server (.url, .port)."""
    from _servers import Server
    server = Server(_server_binaries()[0], str(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A three-master Redis Cluster for the session: Cluster (.url, .nodes)."""
    from _servers import Cluster
    binary, cli = _server_binaries()
    cluster = Cluster(binary, cli, str(tmp_path_factory.mktemp("cluster")))
    yield cluster
    cluster.stop()


@pytest.fixture
def server_factory(tmp_path):
    """Starts servers of the test's own (to kill or to configure), stopped after it:
    start(*args) a redis-server with extra arguments, start(cluster=True) a cluster."""
    from _servers import Cluster, Server
    binary, cli = _server_binaries()
    started = []

    def start(*args, cluster=False):
        workdir = str(tmp_path / f"redis{len(started)}")
        started.append(Cluster(binary, cli, workdir) if cluster
                       else Server(binary, workdir, args=args))
        return started[-1]
    yield start
    for s in started:
        s.stop()
