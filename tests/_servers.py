"""Real Redis (or Valkey) servers for the store tests: started on free loopback ports in
a temporary directory, with no persistence, and stopped by their own pid.

The binaries are looked up on PATH (redis-server / redis-cli, else valkey-server /
valkey-cli); the README's test command installs Debian's redis-server package.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import redis


def binaries() -> tuple[str, str] | None:
    """(server, cli) paths, or None when neither Redis nor Valkey is installed."""
    for server, cli in (("redis-server", "redis-cli"), ("valkey-server", "valkey-cli")):
        s, c = shutil.which(server), shutil.which(cli)
        if s and c:
            return s, c
    return None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_bus: bool = False) -> int:
    """A loopback port free now (and port + 10000, a cluster node's bus, with_bus=True)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus or (port + 10000 < 65536 and _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


class Server:
    """One redis-server process on 127.0.0.1:port, data in directory `workdir`.
    port: a free one by default (another to restart a server where it was); password:
    requirepass and masterauth (clients then authenticate)."""

    def __init__(self, binary: str, workdir: str, *, cluster: bool = False, args=(),
                 port: int | None = None, password: str | None = None):
        os.makedirs(workdir, exist_ok=True)
        self.port = free_port(with_bus=cluster) if port is None else port
        self.workdir = workdir
        self.password = password
        if password is not None:
            args = ("--requirepass", password, "--masterauth", password, *args)
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", workdir, "--daemonize", "no",
               "--logfile", os.path.join(workdir, "server.log"), *args]
        if cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "3000"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5,
                             password=self.password)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited with code "
                                       f"{self.proc.returncode}: {self.log()[-2000:]}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} not ready after "
                                       f"{timeout} s: {self.log()[-2000:]}")
                time.sleep(0.02)
        finally:
            client.close()

    def log(self) -> str:
        try:
            with open(os.path.join(self.workdir, "server.log")) as f:
                return f.read()
        except OSError:
            return ""

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets and answers nothing (a stalled node)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crash would (no shutdown of its own)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()        # a paused server would not see SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """Three master nodes with every slot assigned (redis-cli --cluster create); password:
    every node's requirepass and masterauth."""

    def __init__(self, binary: str, cli: str, workdir: str, nodes: int = 3,
                 password: str | None = None):
        self.nodes: list[Server] = []
        self.password = password
        auth = [] if password is None else ["-a", password, "--no-auth-warning"]
        try:
            for i in range(nodes):
                self.nodes.append(Server(binary, os.path.join(workdir, f"node{i}"), cluster=True,
                                         password=password))
            subprocess.run([cli, *auth, "--cluster", "create",
                            *(f"127.0.0.1:{n.port}" for n in self.nodes),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _wait_ok(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            client = redis.Redis(host="127.0.0.1", port=n.port, password=self.password)
            try:
                while client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {n.port} not ok after {timeout} s")
                    time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
