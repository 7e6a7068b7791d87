"""Shared fixtures. Tests marked `gpu` skip cleanly where no device is usable;
the device is asked about once, when the first such test runs, never at import."""
import functools
import os
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
