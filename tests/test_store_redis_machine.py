"""The pool's prefix state machine with the store's faults in the loop.

StorePrefixMachine (test_pool_state_machine.py: a small pool of each format with a
prefix cache, a chunk store of 2-page chunks and a StoreWriter) runs here over

- a real Redis server that, between steps, is killed (and stays down for a while: saves
  fail, lookups are faults), restarted empty on its port, SIGSTOPped for one lookup
  (which must end at the backend's deadline), and has values corrupted (a flipped byte,
  a truncation, another key's value, a list where a value should be);
- a DirectoryBackend whose files are replaced under it (the same corruptions, and the
  same bytes rewritten, which must still hit).

Invariants, besides the machine's own (every sequence reads back the K/V of its tokens,
byte for byte, whichever tier its pages came from; the cache never lies): each
match_prefix finds what the test predicts from the store's raw contents (read with its
own client or from the files): a valid stored chunk is a hit unless the pool is short of
pages, a corrupt one or a server that is down or stalled is exactly one counted fault and
no page loaded, a missing one is a plain miss; a refused value is deleted; a lookup on a
stalled server ends within its deadline. Two tests also run every fault once in a fixed
order. Examples: KVCORE_STORE_MACHINE_EXAMPLES (default 50 on a directory, 40 on Redis,
about 25 s in all on a busy 2-core machine; the fixed-order tests cover every fault
whatever the draw), steps per example KVCORE_STORE_MACHINE_STEPS (default 30).
"""
import os
import shutil
import tempfile
import time

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvcore import KVPool
from kvcore._prefix_keys import prefix_keys
from kvcore.store import DirectoryBackend, KVStore, RedisBackend, StoreWriter

from _machines import machine_test, one_thread  # noqa: F401  (one_thread: autouse fixture)
from test_pool_state_machine import L, PS, P, PrefixMachine, StorePrefixMachine

EXAMPLES = os.environ.get("KVCORE_STORE_MACHINE_EXAMPLES")
STEPS = int(os.environ.get("KVCORE_STORE_MACHINE_STEPS", "30"))
C = 2 * PS                 # the machine's chunk: 2 pages
DEADLINE = 0.3             # the Redis backend's deadline for a lookup on a stalled server, s
UP_DEADLINE = 30.0         # its deadline otherwise: a server that is up must answer, even
                           # on a machine loaded by the rest of the suite

_redis = {}                # "server": the running _servers.Server, "dir": its directory


def _server():
    """The module's Redis server, restarted (empty) on its port if it is not running."""
    from _servers import Server, binaries
    server = _redis["server"]
    if server.proc.poll() is not None:
        server = _redis["server"] = Server(binaries()[0], _redis["dir"], port=server.port)
    return server


@pytest.fixture(autouse=True, scope="module")
def redis_for_the_machine(tmp_path_factory):
    from _servers import Server, binaries
    found = binaries()
    if found is None:
        yield                  # the Redis machine skips itself
        return
    _redis["dir"] = str(tmp_path_factory.mktemp("machine-redis"))
    _redis["server"] = Server(found[0], _redis["dir"])
    yield
    _redis.pop("server").stop()


class FaultyStoreMachine(StorePrefixMachine):
    """StorePrefixMachine over a backend the test breaks between steps (BACKEND "redis" or
    "directory"); subclassed per format."""

    BACKEND = "directory"

    def __init__(self):
        PrefixMachine.__init__(self)
        self.dir = tempfile.mkdtemp(prefix="kvcore-faulty-store-")
        if self.BACKEND == "redis":
            import redis
            self.raw = redis.Redis(port=_server().port, socket_timeout=5)
            self.raw.flushall()
            backend = RedisBackend(_redis["server"].url, connect_timeout=UP_DEADLINE,
                                   read_timeout=UP_DEADLINE, deadline=UP_DEADLINE)
        else:
            backend = DirectoryBackend(self.dir, fsync=False)
        self.store = KVStore(backend, model="machine", spec=self.spec, chunk_tokens=C,
                             page_size=PS)
        self.writer = StoreWriter(self.store)
        self.pool = KVPool(self.spec, num_pages=P, page_size=PS, prefix_cache=True,
                           store=self.store, store_writer=self.writer)
        self.saved = []
        self.known = {}            # chunk key -> (ids, extra) of every whole first chunk seen
        self.bad = set()           # keys whose stored value the test corrupted
        self.valid = {}            # key -> the value its save wrote (kept while corrupt)
        self.down = False          # the Redis server is killed
        self.stalled = False       # the Redis server is SIGSTOPped (within one rule)
        self.expect = None
        self.computed = None          # the ids of compute's latest sequence

    def teardown(self):
        self.writer.close()
        self.store.backend.close()
        if self.BACKEND == "redis":
            self.raw.close()
            _redis["server"].resume()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ the store, raw

    def chunk_key(self, ids, extra):
        return self.store.keys(ids[:C], extra)[0]

    def stored(self, key):
        """The raw value under key (None: none), read past the backend under test."""
        if self.BACKEND == "redis":
            return self.raw_get(key) if self.raw.exists(key) else None
        try:
            with open(self.store.backend._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def raw_get(self, key):
        import redis
        try:
            return self.raw.get(key)
        except redis.exceptions.ResponseError:   # WRONGTYPE: a list is stored there
            return b"<a list>"

    def put_raw(self, key, value):
        if self.BACKEND == "redis":
            self.raw.set(key, value)
            return
        path = self.store.backend._path(key)
        with open(path + ".test", "wb") as f:
            f.write(value)
        os.replace(path + ".test", path)      # replaced under the backend

    def remember(self, ids, extra):
        if len(ids) >= C:
            self.known[self.chunk_key(ids, extra)] = (list(ids[:C]), extra)

    # ------------------------------------------------------------------ steps

    def pool_advance(self, seqs=None):
        failed = self.writer.stats.failed
        out = PrefixMachine.pool_advance(self, seqs)
        assert self.writer.flush() == 0
        if not self.down:
            assert self.writer.stats.failed == failed, self.writer.stats.last_error
        for s, m in self.model.items():
            n = self.pool.length(s)        # the model's length is updated by the caller
            if m.keyed:
                self.remember(m.ids[:n], m.extra)
                if n >= C and (m.ids[:n], m.extra) not in self.saved:
                    self.saved.append((m.ids[:n], m.extra))
        return out

    def new_pool(self):
        """Another pool over the same store (a restarted server process)."""
        self.pool = KVPool(self.spec, num_pages=P, page_size=PS, prefix_cache=True,
                           store=self.store, store_writer=self.writer)
        self.model = {}

    def match_tokens(self, tokens, extra):
        """The machine's match, with what it must find predicted from the raw store."""
        x = self.EXTRAS[extra]
        index = self.pool._table.prefix
        pages = 0
        for key in prefix_keys(tokens, PS, x)[:max(0, (len(tokens) - 1) // PS)]:
            if key not in index.by_key:
                break
            pages += 1
        n0 = pages * PS
        state = None                        # no lookup
        if len(tokens) - 1 >= C and n0 < C:
            key = self.chunk_key(tokens, x)
            if self.down or self.stalled:
                state = "fault"
            else:
                value = self.stored(key)
                state = "miss" if value is None else "fault" if key in self.bad else "hit"
        self.expect = (n0, state)
        self.remember(tokens, x)
        t0 = time.monotonic()
        super().match_tokens(tokens, extra)
        took = time.monotonic() - t0
        if state is not None and not self.down and not self.stalled:
            key = self.chunk_key(tokens, x)
            if state == "fault":                 # refused: deleted from the store
                assert self.stored(key) is None
                self.bad.discard(key)
                self.valid.pop(key, None)
        if self.stalled and state is not None:
            assert took < DEADLINE + 1.0, took

    def check_counts(self, before, after, tokens, n):
        n0, state = self.expect
        loaded = after.store_hits - before.store_hits
        faults = after.store_faults - before.store_faults
        assert after.hits - before.hits == n0 // PS
        assert after.hits - before.hits + loaded == n // PS
        assert after.misses - before.misses == max(0, (len(tokens) - 1) // PS) - n // PS
        assert faults == (state == "fault"), (state, after.last_store_fault)
        if state == "hit" and n == n0:       # only a pool short of pages keeps it out
            assert after.free + after.cached < (C - n0) // PS
        elif state == "hit":
            assert n == C
        else:
            assert n == n0 and loaded == 0

    @precondition(lambda self: len(self.model) < 4)
    @rule(seed=st.integers(0, 2**32 - 1), free=st.booleans())
    def compute(self, seed, free):
        """A new sequence of C + 1 positions computed and committed (its first chunk goes
        to the store), then freed into the cache or kept."""
        self.new()
        s = max(self.model)
        for layer in range(L):
            if not self.batch(layer, [s], [C + 1], seed + layer):
                return
        assert self.pool_advance([s]) == [C + 1]
        m = self.model[s]
        m.length += C + 1
        m.pending = [0] * L
        self.computed = list(m.ids[:C + 1])
        if free:
            self.free(pick=sorted(self.model).index(s))

    @precondition(lambda self: self.known and not self.down)
    @rule(data=st.data(), how=st.sampled_from(["flip", "truncate", "foreign", "list",
                                                "same"]), seed=st.integers(0, 2**32 - 1))
    def corrupt(self, data, how, seed):
        """Replaces a stored chunk's value: broken (refused when looked up) or the same
        bytes written again (still a hit)."""
        stored = [k for k in sorted(self.known) if self.stored(k) is not None]
        if not stored:
            return
        key = data.draw(st.sampled_from(stored))
        other = data.draw(st.sampled_from(stored))
        self.break_value(key, how, seed, other)

    def break_value(self, key, how, seed=0, other=None) -> bool:
        """Replaces key's stored value (how: flip, truncate, foreign, list, same); whether
        it did."""
        value = self.stored(key)
        if value in (None, b"", b"<a list>"):
            return False
        if key not in self.bad:
            self.valid[key] = value
        rng = np.random.default_rng(seed)
        if how == "flip":
            at = int(rng.integers(len(value)))
            value = value[:at] + bytes([value[at] ^ (1 << int(rng.integers(8)))]) + value[at + 1:]
        elif how == "truncate":
            value = value[:int(rng.integers(len(value)))]
        elif how == "foreign":
            if other is None or other == key:
                return False
            value = self.stored(other)
            if value in (None, b"<a list>"):
                return False
        elif how == "list":
            if self.BACKEND != "redis":
                return False
            self.raw.delete(key)
            self.raw.rpush(key, b"not a value")
            self.bad.add(key)
            return True
        self.put_raw(key, value)
        if value == self.valid[key]:       # "same", or a byte flipped back
            self.bad.discard(key)
        else:
            self.bad.add(key)
        return True

    @precondition(lambda self: self.BACKEND == "redis" and not self.down)
    @rule()
    def kill(self):
        """The server crashes: saves fail (counted by the writer), lookups are faults."""
        _redis["server"].kill()
        self.down = True

    @precondition(lambda self: self.BACKEND == "redis" and self.down)
    @rule()
    def restart_server(self):
        """A new, empty server on the same port: the backend reconnects."""
        _server()
        self.down = False
        self.bad.clear()
        self.valid.clear()

    @precondition(lambda self: self.BACKEND == "redis" and not self.down and self.known
                  and len(self.model) < 4)
    @rule(data=st.data(), tail=st.integers(0, 2))
    def stalled_match(self, data, tail):
        """A lookup while the server is SIGSTOPped: a fault at the deadline."""
        ids, extra = self.known[data.draw(st.sampled_from(sorted(self.known)))]
        self.match_stalled(ids + [1] * (1 + tail), self.EXTRAS.index(extra))

    def match_stalled(self, tokens, extra):
        """match_tokens while the server is SIGSTOPped, under the backend's short deadline
        (read per call: the socket's own read timeout is longer, the deadline ends it)."""
        server, backend = _redis["server"], self.store.backend
        server.pause()
        self.stalled, backend.deadline = True, DEADLINE
        try:
            self.match_tokens(tokens, extra)
        finally:
            self.stalled, backend.deadline = False, UP_DEADLINE
            server.resume()


def _redis_missing():
    from _servers import binaries
    return binaries() is None


def _scenario(backend):
    """Every fault of the machine once, in a fixed order (hypothesis draws them at random):
    each match's outcome is checked by the machine (check_counts), then its invariants."""
    machine = type(f"Scenario_{backend}", (FaultyStoreMachine,),
                   {"FORMAT": "int8", "BACKEND": backend})
    m = machine()
    outcomes = []

    def check():
        m.pages_add_up()
        m.reads_back_what_was_written()
        m.cache_never_lies()

    def match(tokens, stalled=False):
        m.new_pool()                  # nothing cached: the store is asked
        (m.match_stalled if stalled else m.match_tokens)(tokens, 0)
        outcomes.append(m.expect[1])
        check()

    def computed(seed):
        m.new_pool()
        m.compute(seed=seed, free=True)
        check()
        return m.computed

    try:
        a = computed(1)
        b = next(t for t in (computed(s) for s in range(2, 40)) if t[:C] != a[:C])
        match(a)                                          # hit
        key_a, key_b = m.chunk_key(a, None), m.chunk_key(b, None)
        assert m.break_value(key_a, "same")
        match(a)                                          # the same bytes: still a hit
        for how, seed in (("flip", 3), ("truncate", 4), ("foreign", 0), ("list", 0)):
            if m.break_value(key_a, how, seed, other=key_b):
                match(a)                                  # a fault, the value deleted
                assert computed(1) == a                   # saved again
        match(b)
        if backend == "redis":
            match(b, stalled=True)                        # a fault at the deadline
            match(b)                                      # the server answers again
            m.kill()
            match(b)                                      # a fault: refused connection
            computed(5)                                   # its save fails (counted)
            m.restart_server()                            # empty
            match(b)                                      # a miss
            b = computed(2)
            match(b)                                      # a hit: reconnected
    finally:
        m.teardown()
    return outcomes


def test_every_fault_in_order_on_a_directory():
    assert _scenario("directory") == ["hit", "hit", "fault", "fault", "fault", "hit"]


@pytest.mark.skipif(_redis_missing(), reason="no redis-server on PATH")
def test_every_fault_in_order_on_redis():
    assert _scenario("redis") == ["hit", "hit", "fault", "fault", "fault", "fault", "hit",
                                  "fault", "hit", "fault", "miss", "hit"]


def _machine_test(fmt, backend):
    return machine_test(FaultyStoreMachine, f"FaultyStoreMachine_{backend}_{fmt}",
                        {"FORMAT": fmt, "BACKEND": backend},
                        int(EXAMPLES or {"directory": 50, "redis": 40}[backend]), STEPS)


TestFaultyDirectoryStore = _machine_test("int8", "directory")
TestFaultyRedisStore = pytest.mark.skipif(_redis_missing(), reason="no redis-server on PATH")(
    _machine_test("bf16", "redis"))
