"""The store's faults as the prefix cache and `load` see them: a Redis server (real, or a
fake one on loopback answering crafted RESP replies) that answers GET with something
that is no value, trickles its reply or stalls, a SIGSTOPped cluster node, credentials
that must never show, and a pool that stays usable by other threads while a lookup
waits (and never places K/V that does not belong to the prompt when its cache changed
meanwhile). Every fault is a counted miss within the backend's deadline; match_prefix
raises for nothing the store does, and leaves nothing behind when it raises at all."""
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvcore import KVCache, KVPool
from kvcore.errors import RangeError, StoreError
from kvcore.store import DirectoryBackend, KVStore, RedisBackend

from _toy_model import decode, prefill
from test_store import C, spec_of

PAGE = 8
PER = C // PAGE
PASSWORD = "s3cr3t-Pa55w0rd"


def _store(backend, spec, model="faults"):
    return KVStore(backend, model=model, spec=spec, chunk_tokens=C, page_size=PAGE)


def _computed(spec, tokens):
    cache = KVCache(spec)
    prefill(cache, tokens)
    return cache


def _pool(store, spec, pages=40):
    return KVPool(spec, num_pages=pages, page_size=PAGE, prefix_cache=True, store=store)


def _holds(pool, s, cache, n):
    """Sequence s of the pool holds cache's positions [0, n) byte for byte, every layer."""
    for layer in range(pool.spec.num_layers):
        for x, y in zip(pool._gather(s, layer), cache._layer_arrays(layer)):
            if x is not None and not np.array_equal(x[:n].view(np.uint8), y[:n].view(np.uint8)):
                return False
    return True


def _state(pool):
    """What an atomic call must leave as it was."""
    t = pool._table
    return (pool.stats, list(t.seqs), sorted(t.free), sorted(t.prefix.lru), list(t.refs),
            dict(t.prefix.by_key))


# ------------------------------------------------------------------ a fake server

class FakeRedis:
    """A Redis stand-in on a loopback port: `get(key)` gives the raw RESP reply to a GET
    (None: never answer); EXISTS answers 0, DEL 1, anything else +OK (the client's
    handshake; HELLO a RESP3 map; silent: nothing at all). trickle: seconds between the
    bytes of a GET's reply.
    Commands received are in `commands` (lists of bytes)."""

    HELLO = b"%2\r\n$6\r\nserver\r\n$5\r\nredis\r\n$5\r\nproto\r\n:3\r\n"

    def __init__(self, get, trickle=0.0, silent=False):
        self.get, self.trickle, self.silent = get, trickle, silent
        self.commands = []
        self._stop = threading.Event()
        self._conns = []
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        f = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                line = f.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    size = int(f.readline()[1:])
                    args.append(f.read(size + 2)[:-2])
                self.commands.append(args)
                if self.silent:                 # not even the handshake is answered
                    self._stop.wait()
                    return
                name = args[0].upper()
                if name == b"GET":
                    reply = self.get(args[1].decode())
                    if reply is None:
                        self._stop.wait()
                        return
                    if self.trickle:
                        for i in range(len(reply)):
                            if self._stop.wait(self.trickle):
                                return
                            conn.sendall(reply[i:i + 1])
                        continue
                else:
                    reply = {b"EXISTS": b":0\r\n", b"DEL": b":1\r\n", b"HELLO": self.HELLO}.get(
                        name, b"+OK\r\n")
                conn.sendall(reply)
        except (OSError, ValueError):
            return
        finally:
            f.close()
            conn.close()

    def seen(self, name):
        return [c for c in list(self.commands) if c[0].upper() == name]

    def close(self):
        self._stop.set()
        self._listener.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture
def fake():
    made = []

    def start(get, trickle=0.0, silent=False):
        made.append(FakeRedis(get, trickle, silent))
        return made[-1]
    yield start
    for f in made:
        f.close()


@pytest.fixture
def own_server(tmp_path):
    """start(password=None, cluster=False): a server or cluster of the test's own,
    stopped after it (a paused one is resumed first)."""
    from _servers import Cluster, Server, binaries
    found = binaries()
    if found is None:
        pytest.skip("no redis-server (or valkey-server) on PATH")
    started = []

    def start(password=None, cluster=False):
        workdir = str(tmp_path / f"redis{len(started)}")
        started.append(Cluster(*found, workdir, password=password) if cluster
                       else Server(found[0], workdir, password=password))
        return started[-1]
    yield start
    for s in started:
        s.stop()


# ------------------------------------------------------------------ replies that are no value

@pytest.mark.parametrize("reply, why", [
    (b":5\r\n", "an integer (5)"),
    (b"*2\r\n$1\r\na\r\n$1\r\nb\r\n", "an array of 2"),
    (b"*0\r\n", "an array of 0"),
    (b",1.5\r\n", "a float"),
    (b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
     "an error (WRONGTYPE"),
])
def test_a_get_answered_with_no_value_is_a_refused_chunk(fake, reply, why, rng):
    server = fake(lambda key: reply)
    spec = spec_of()
    prompt = rng.integers(0, 50000, 2 * C + 1)
    store = _store(RedisBackend(server.url), spec)
    result = store.load(prompt)                      # no exception: a refused chunk
    assert (result.positions, result.snapshot) == (0, None)
    assert result.miss.startswith(f"chunk 0 refused: the server answered GET with {why}")
    assert server.seen(b"DEL")[-1][1].decode() == store.keys(prompt)[0]   # deleted
    pool = _pool(store, spec)
    s, n = pool.match_prefix(prompt)
    st = pool.stats
    assert n == 0 and pool.length(s) == 0
    assert (st.store_faults, st.store_hits, st.misses) == (1, 0, 2 * PER)
    assert st.last_store_fault.startswith("chunk 0 refused: the server answered GET with")
    store.backend.close()


@pytest.mark.parametrize("reply", [b"-ERR the server is unhappy\r\n", b"?garbage\r\n"])
def test_a_get_answered_with_an_error_or_garbage_is_a_failed_lookup(fake, reply, rng):
    server = fake(lambda key: reply)
    spec = spec_of()
    prompt = rng.integers(0, 50000, 2 * C + 1)
    store = _store(RedisBackend(server.url), spec)
    with pytest.raises(StoreError, match=rf"^redis 127\.0\.0\.1:{server.port}: GET of 2 keys "
                                         rf"failed: "):
        store.load(prompt)
    pool = _pool(store, spec)
    s, n = pool.match_prefix(prompt)                 # never raises for the store
    st = pool.stats
    assert n == 0 and st.store_faults == 1 and pool.sequences == [s]
    assert st.last_store_fault.startswith(f"redis 127.0.0.1:{server.port}: GET of 2 keys failed")
    store.backend.close()


def test_a_client_with_decode_responses_reads_values_as_bytes(redis_server, rng):
    import redis
    spec = spec_of()
    prompt = rng.integers(0, 50000, 3 * C + 1)
    cache = _computed(spec, prompt)
    _store(RedisBackend(redis_server.url), spec, "decode").save(cache.snapshot(), prompt)
    for backend in (RedisBackend(client=redis.Redis(port=redis_server.port,
                                                    decode_responses=True)),
                    RedisBackend(redis_server.url + "?decode_responses=True")):
        store = _store(backend, spec, "decode")
        result = store.load(prompt)
        assert (result.positions, result.miss) == (3 * C, None)
        assert store.lookup(prompt) == 3 * C
        pool = _pool(store, spec)
        s, n = pool.match_prefix(prompt)
        assert n == 3 * C and pool.stats.store_faults == 0 and _holds(pool, s, cache, n)
        backend.close()


def test_a_cluster_client_with_decode_responses_reads_values_as_bytes(redis_cluster, rng):
    from redis.cluster import RedisCluster
    spec = spec_of()
    prompt = rng.integers(0, 50000, 6 * C + 1)
    cache = _computed(spec, prompt)
    _store(RedisBackend(redis_cluster.url, cluster=True), spec, "decode").save(
        cache.snapshot(), prompt)
    backend = RedisBackend(client=RedisCluster(host="127.0.0.1",
                                               port=redis_cluster.nodes[0].port,
                                               decode_responses=True))
    pool = _pool(_store(backend, spec, "decode"), spec)
    s, n = pool.match_prefix(prompt)
    assert n == 6 * C and pool.stats.store_faults == 0 and _holds(pool, s, cache, n)
    backend.close()


# ------------------------------------------------------------------ match_prefix is atomic

def _saved(tmp_path, spec, prompt, backend=None):
    store = _store(backend or DirectoryBackend(tmp_path, fsync=False), spec)
    store.save(_computed(spec, prompt).snapshot(), prompt)
    return store


def test_match_prefix_that_raises_while_placing_leaves_the_pool_as_it_was(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 3 * C + 1)
    store = _saved(tmp_path, spec, prompt)
    pool = _pool(store, spec)
    s = pool.new_sequence()
    prefill(pool, prompt[:C], s)          # chunk 0 cached: the match takes its pages
    pool.free(s)
    before = _state(pool)
    calls = []

    def failing(*args):                   # the second chunk's copy fails
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("injected")
        return KVPool._put_rows(pool, *args)
    pool._put_rows = failing
    with pytest.raises(MemoryError, match="injected"):
        pool.match_prefix(prompt)
    assert _state(pool) == before         # no sequence, pages and counters as they were
    del pool._put_rows
    t, n = pool.match_prefix(prompt)
    assert n == 3 * C and pool.sequences == [t]
    assert _holds(pool, t, _computed(spec, prompt), n)


class _Abort(BaseException):
    """Raised by a backend: no Exception (as KeyboardInterrupt is not)."""


class _Raising(DirectoryBackend):
    def __init__(self, root, error):
        super().__init__(root, fsync=False)
        self.error = error

    def get_prefix(self, keys):
        raise self.error

    def read_prefix(self, keys, max_value_bytes=None):
        raise self.error
        yield


def test_a_store_that_raises_leaves_no_sequence_behind(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 3 * C + 1)
    _saved(tmp_path, spec, prompt)
    backend = _Raising(tmp_path, _Abort())
    pool = _pool(_store(backend, spec), spec)
    s = pool.new_sequence()
    prefill(pool, prompt[:PAGE], s)       # one page cached: the match takes it
    pool.free(s)
    before = _state(pool)
    with pytest.raises(_Abort):
        pool.match_prefix(prompt)
    assert _state(pool) == before
    backend.error = TypeError("a bug in a backend")   # an Exception: a counted fault
    t, n = pool.match_prefix(prompt)
    st = pool.stats
    assert n == PAGE and pool.sequences == [t] and st.store_faults == 1
    assert "TypeError: a bug in a backend" in st.last_store_fault


# ------------------------------------------------------------------ the guard and the cache

class _Gated(DirectoryBackend):
    """Reads wait at `gate` once `armed` (`entered` tells that one waits)."""

    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.armed = False
        self.gate, self.entered = threading.Event(), threading.Event()

    def _wait(self):
        if self.armed:
            self.entered.set()
            assert self.gate.wait(20)

    def get_prefix(self, keys):
        self._wait()
        return super().get_prefix(keys)

    def read_prefix(self, keys, max_value_bytes=None):
        self._wait()
        yield from super().read_prefix(keys, max_value_bytes)


def _in_thread(call):
    """Runs call on a thread; returns (thread, box): box["out"] or box["error"], box["s"]
    its duration."""
    box = {}

    def run():
        t0 = time.monotonic()
        try:
            box["out"] = call()
        except BaseException as e:  # noqa: BLE001 (the test looks at it)
            box["error"] = e
        box["s"] = time.monotonic() - t0
    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def test_the_pool_serves_other_calls_while_a_lookup_waits_and_the_cache_grows(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 4 * C + 1)
    new = rng.integers(0, 50000, 3)
    backend = _Gated(tmp_path)
    store = _saved(tmp_path, spec, prompt, backend)
    pool = _pool(store, spec)
    backend.armed = True
    thread, box = _in_thread(lambda: pool.match_prefix(prompt))
    assert backend.entered.wait(10)
    # the lookup waits on the "disk": every call of another thread goes on, and this one
    # caches chunk 0 and a page of chunk 1 meanwhile
    s = pool.new_sequence()
    prefill(pool, prompt[:C + PAGE], s)
    other = pool.new_sequence()
    prefill(pool, rng.integers(0, 50000, 5), other)
    pool.free(s)
    pool.free(other)
    assert pool.stats.hits == 0
    backend.gate.set()
    thread.join(20)
    t, n = box["out"]
    st = pool.stats
    # matched again under the guard: the cached pages, then the chunks past them
    assert n == 4 * C and (st.hits, st.store_hits, st.misses) == (PER + 1, 3 * PER - 1, 0)
    cache = _computed(spec, prompt)
    assert _holds(pool, t, cache, n)
    prefill(pool, prompt[n:], t)
    assert np.array_equal(decode(pool, new, t).view(np.uint32),
                          decode(cache, new).view(np.uint32))


def test_a_cache_that_lost_pages_during_a_lookup_gets_no_chunk_out_of_place(tmp_path, rng):
    spec = spec_of()
    prompt = rng.integers(0, 50000, 3 * C + 1)
    backend = _Gated(tmp_path)
    store = _saved(tmp_path, spec, prompt, backend)
    pool = _pool(store, spec, pages=12)
    s = pool.new_sequence()
    prefill(pool, prompt[:C], s)          # chunk 0 cached: the lookup asks for chunks 1, 2
    pool.free(s)
    backend.armed = True
    thread, box = _in_thread(lambda: pool.match_prefix(prompt))
    assert backend.entered.wait(10)
    other = pool.new_sequence()           # takes the 10 free pages and one cached: the
    prefill(pool, rng.integers(0, 50000, 11 * PAGE), other)   # leaf of chunk 0 goes
    pool.free(other)
    assert pool.stats.evictions == 1
    backend.gate.set()
    thread.join(20)
    t, n = box["out"]
    st = pool.stats
    # page 0 is still cached, but chunk 1 starts at position C: a gap, nothing placed
    assert n == PAGE and (st.hits, st.store_hits, st.store_faults) == (1, 0, 0)
    cache = _computed(spec, prompt)
    assert _holds(pool, t, cache, n)
    prefill(pool, prompt[n:], t)
    assert _holds(pool, t, cache, len(prompt))


def test_a_lookup_on_a_stalled_server_ends_at_its_deadline_and_the_pool_goes_on(fake, rng):
    server = fake(lambda key: None)       # accepts, answers the handshake, never a GET
    spec = spec_of()
    prompt = rng.integers(0, 50000, 2 * C + 1)
    store = _store(RedisBackend(server.url, read_timeout=30, deadline=1.0), spec)
    pool = _pool(store, spec)
    thread, box = _in_thread(lambda: pool.match_prefix(prompt))
    while not server.seen(b"GET"):
        time.sleep(0.01)
    for _ in range(5):                    # while the lookup waits
        s = pool.new_sequence()
        prefill(pool, rng.integers(0, 50000, 9), s)
        pool.free(s)
    thread.join(10)
    t, n = box["out"]
    st = pool.stats
    assert n == 0 and pool.sequences == [t] and 1.0 <= box["s"] < 2.5
    assert st.store_faults == 1 and st.last_store_fault == (
        f"redis 127.0.0.1:{server.port}: GET of 2 keys failed: no answer within the "
        f"deadline of 1 s")
    store.backend.close()


# ------------------------------------------------------------------ deadlines

def test_deadlines_are_stated_and_checked():
    backend = RedisBackend("redis://127.0.0.1:1/0")       # connects at its first call
    assert (backend.connect_timeout, backend.read_timeout, backend.deadline) == (2.0, 5.0, 10.0)
    backend.close()
    for name in ("connect_timeout", "read_timeout", "deadline"):
        for bad in (0, -1, float("inf"), float("nan"), True, "1"):
            with pytest.raises(RangeError, match=f"^{name} must be a positive, finite number"):
                RedisBackend("redis://127.0.0.1:1/0", **{name: bad})


def test_a_call_stuck_in_a_handshake_holds_up_neither_its_caller_nor_the_exit(fake):
    server = fake(None, silent=True)      # accepts, then answers nothing, not even HELLO
    code = ("import time\n"
            "from kvcore.errors import StoreError\n"
            "from kvcore.store import RedisBackend\n"
            f"backend = RedisBackend({server.url!r}, read_timeout=60, deadline=0.3)\n"
            "t0 = time.monotonic()\n"
            "try:\n"
            "    backend.get_prefix(['k'])\n"
            "except StoreError as e:\n"
            "    print(round(time.monotonic() - t0, 1), e)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    # the worker still waits in redis-py's handshake (60 s): a daemon thread, it does
    # not keep the process from exiting
    assert time.monotonic() - t0 < 15, out
    assert out.stdout.endswith(f"redis 127.0.0.1:{server.port}: GET of 1 keys failed: no "
                               f"answer within the deadline of 0.3 s\n"), out
    assert float(out.stdout.split()[0]) < 1.0, out


def test_a_trickling_server_is_a_fault_at_the_deadline(fake, rng):
    value = b"x" * 100_000                 # one byte every 0.1 s: each read gets one
    server = fake(lambda key: b"$%d\r\n%s\r\n" % (len(value), value), trickle=0.1)
    spec = spec_of()
    prompt = rng.integers(0, 50000, C + 1)
    store = _store(RedisBackend(server.url, read_timeout=1.0, deadline=0.5), spec)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=rf"^redis 127\.0\.0\.1:{server.port}: GET of 1 keys "
                                         rf"failed: no answer within the deadline of 0\.5 s$"):
        store.load(prompt)
    assert time.monotonic() - t0 < 1.5
    pool = _pool(store, spec)
    t0 = time.monotonic()
    s, n = pool.match_prefix(prompt)
    assert time.monotonic() - t0 < 1.5
    assert n == 0 and pool.stats.store_faults == 1
    store.backend.close()


def test_a_sigstopped_cluster_node_is_a_fault_at_the_deadline(own_server, rng):
    cluster = own_server(cluster=True)
    spec = spec_of()
    prompt = rng.integers(0, 50000, 9 * C + 1)
    cache = _computed(spec, prompt)
    writer = _store(RedisBackend(cluster.url, cluster=True), spec)
    writer.save(cache.snapshot(), prompt)
    backend = RedisBackend(cluster.url, cluster=True, connect_timeout=0.5, read_timeout=30,
                           deadline=0.8)
    store = _store(backend, spec)
    held = {backend.client.get_node_from_key(k).port for k in store.keys(prompt)}
    assert len(held) == 3                 # the chunks lie on every node
    node = next(n for n in cluster.nodes if n.port == backend.client.get_node_from_key(
        store.keys(prompt)[4]).port)
    pool = _pool(store, spec)
    node.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"^redis cluster redis://127\.0\.0\.1:\d+/0: GET "
                                             r"of 9 keys failed: no answer within the "
                                             r"deadline of 0\.8 s$"):
            store.load(prompt)
        assert time.monotonic() - t0 < 1.5
        entered, get = threading.Event(), backend.get_prefix
        backend.get_prefix = lambda keys: (entered.set(), get(keys))[1]
        thread, box = _in_thread(lambda: pool.match_prefix(prompt))
        assert entered.wait(10)
        for _ in range(3):                # the pool serves this thread meanwhile
            s = pool.new_sequence()
            prefill(pool, rng.integers(0, 50000, 3), s)
            pool.free(s)
        thread.join(10)
        t, n = box["out"]
        assert n == 0 and box["s"] < 1.5 and pool.stats.store_faults == 1
        assert "no answer within the deadline of 0.8 s" in pool.stats.last_store_fault
        pool.free(t)
    finally:
        node.resume()
    deadline = time.monotonic() + 15      # the node answers again: lookups hit again
    while True:
        try:
            if store.load(prompt).positions == 9 * C:
                break
        except StoreError:
            pass
        assert time.monotonic() < deadline, "the cluster did not serve the prefix again"
        time.sleep(0.2)
    t, n = pool.match_prefix(prompt)
    assert n == 9 * C and _holds(pool, t, cache, n)
    backend.close()
    writer.backend.close()


# ------------------------------------------------------------------ credentials

def _no_secret(*texts):
    for text in texts:
        assert PASSWORD not in str(text), text


@pytest.mark.parametrize("form", ["redis://:{pw}@127.0.0.1:{port}/0",
                                  "redis://default:{pw}@127.0.0.1:{port}/0",
                                  "redis://127.0.0.1:{port}/0?password={pw}", "client"])
def test_a_servers_password_shows_nowhere(own_server, form, rng, caplog):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    server = own_server(password=PASSWORD)
    spec = spec_of()
    prompt = rng.integers(0, 50000, 2 * C + 1)

    def backend(password=PASSWORD):
        if form == "client":
            return RedisBackend(client=redis.Redis(host="127.0.0.1", port=server.port,
                                                    password=password,
                                                    retry=Retry(NoBackoff(), 0)))
        return RedisBackend(form.format(pw=password, port=server.port))
    ok = backend()
    assert ok.name == f"redis 127.0.0.1:{server.port}"
    _no_secret(repr(ok))
    store = _store(ok, spec)
    assert store.save(_computed(spec, prompt).snapshot(), prompt) == 2
    assert store.load(prompt).positions == 2 * C
    wrong = _store(backend(PASSWORD + "-wrong"), spec)     # refused: the message hides it
    with pytest.raises(StoreError, match=r"AuthenticationError") as e:
        wrong.load(prompt)
    assert "-wrong" not in str(e.value)
    server.kill()
    pool = _pool(store, spec)
    caplog.set_level(logging.INFO, "kvcore.store")
    s, n = pool.match_prefix(prompt)
    with pytest.raises(StoreError) as e:
        store.load(prompt)
    assert n == 0 and pool.stats.store_faults == 1
    _no_secret(e.value, pool.stats, caplog.text, repr(store.backend))
    ok.close()


def test_a_cluster_password_shows_nowhere(own_server, rng, caplog):
    cluster = own_server(password=PASSWORD, cluster=True)
    port = cluster.nodes[0].port
    url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    spec = spec_of()
    prompt = rng.integers(0, 50000, 6 * C + 1)
    backend = RedisBackend(url, cluster=True)
    assert backend.name == f"redis cluster redis://127.0.0.1:{port}/0"
    _no_secret(repr(backend))
    store = _store(backend, spec)
    assert store.save(_computed(spec, prompt).snapshot(), prompt) == 6
    assert store.load(prompt).positions == 6 * C
    with pytest.raises(StoreError, match=r"^redis cluster redis://127\.0\.0\.1:\d+/0: connect "
                                         r"failed: ") as e:
        RedisBackend(url.replace(PASSWORD, PASSWORD + "-wrong"), cluster=True)
    assert "-wrong" not in str(e.value)
    caplog.set_level(logging.INFO, "kvcore.store")
    for node in cluster.nodes[1:]:
        node.kill()
    pool = _pool(store, spec)
    s, n = pool.match_prefix(prompt)
    with pytest.raises(StoreError, match=r"^redis cluster redis://127\.0\.0\.1:\d+/0: GET of 6 "
                                         r"keys failed") as e:
        store.load(prompt)
    assert n == 0 and pool.stats.store_faults == 1
    _no_secret(e.value, pool.stats, caplog.text)
    cluster.nodes[0].kill()
    with pytest.raises(StoreError, match=r"^redis cluster redis://127\.0\.0\.1:\d+/0: connect "
                                         r"failed: ") as e:
        RedisBackend(url, cluster=True)
    _no_secret(e.value)
    backend.close()


@pytest.mark.parametrize("cluster", [False, True])
def test_a_rediss_url_fails_without_showing_its_password(redis_server, cluster, rng, caplog):
    url = f"rediss://user:{PASSWORD}@127.0.0.1:{redis_server.port}/0"   # a plain server
    caplog.set_level(logging.INFO, "kvcore.store")
    if cluster:
        with pytest.raises(StoreError, match=rf"^redis cluster rediss://127\.0\.0\.1:"
                                             rf"{redis_server.port}/0: connect failed: ") as e:
            RedisBackend(url, cluster=True)
        _no_secret(e.value)
        return
    backend = RedisBackend(url)
    spec = spec_of()
    pool = _pool(_store(backend, spec), spec)
    s, n = pool.match_prefix(rng.integers(0, 50000, C + 1))
    assert n == 0 and pool.stats.store_faults == 1
    assert pool.stats.last_store_fault.startswith(f"redis 127.0.0.1:{redis_server.port}: GET "
                                                  f"of 1 keys failed: ")
    _no_secret(pool.stats, caplog.text, repr(backend))
    backend.close()
