"""The host tier of a GpuKVPool (host=KVPool): cached pages the GPU takes back move to the
host pool under their keys, match_prefix brings them back, copies run on a transfer stream
ordered by events, and a step waits only for the pages it touches. The reference is a CPU
KVPool that computed every prompt and never evicts: its page for a key holds the bytes."""
import pathlib
import shutil
import tempfile

import numpy as np
import pytest

from kvcore import CapacityError, CudaError, KVPool, KVSpec, SpecError, StateError

from test_gpu_pool import dev
from test_gpu_prefix import kv_of

pytestmark = pytest.mark.gpu

L, H, D, PS = 2, 2, 64, 4


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


def spec(fmt="int8"):
    return KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=64, num_heads=4, format=fmt)


class Tiers:
    """A GpuKVPool of few pages over a host KVPool, and a large CPU reference pool."""

    def __init__(self, gpu, fmt="int8", pages=6, host_pages=16, **store):
        self.gpu = gpu
        self.host = KVPool(spec(fmt), host_pages, PS, prefix_cache=True) if host_pages else None
        self.g = gpu.GpuKVPool(spec(fmt), pages, PS, max_batch=2, max_pages_per_seq=8,
                               max_tokens=16, prefix_cache=True, host=self.host, **store)
        self.ref = KVPool(spec(fmt), 64, PS, prefix_cache=True)
        self.keep = []

    def prefill(self, tokens):
        """match_prefix, then the rest in one step (computed on the reference once)."""
        s, n = self.g.match_prefix(tokens)
        self.ref_prefill(tokens)
        self.step([s], [tokens[n:]], [tokens])
        return s, n

    def ref_prefill(self, tokens):
        r, m = self.ref.match_prefix(tokens)
        kv = kv_of(tokens)[m:]
        if len(kv):
            for layer in range(L):
                self.ref.append(kv, -kv, seq=r, layer=layer)
            self.ref.advance(r, tokens=tokens[m:])
        self.ref.free(r)

    def step(self, seqs, news, fulls):
        counts = [len(t) for t in news]
        self.g.begin_step(seqs, counts)
        kv = np.concatenate([kv_of(f)[len(f) - len(t):] for t, f in zip(news, fulls)])
        for layer in range(L):
            self.keep += [dev(self.gpu, kv), dev(self.gpu, -kv)]
            self.g.append(layer, self.keep[-2], self.keep[-1])
        self.g.advance(tokens=news)

    def same_bytes(self, s, pool=None):
        """Every page of sequence s of the GPU pool (or of CPU `pool`) holds the
        reference's bytes for its key."""
        pool = self.g if pool is None else pool
        seq, rt = pool._table.get(s), self.ref._table
        for g, key in zip(seq.pages, seq.keys):
            r = rt.prefix.by_key[key]
            for layer in range(L):
                if pool is self.g:
                    views = [self.g.keys(layer), self.g.values(layer)]
                    if self.g.spec.fmt.quantized:
                        views += [self.g.key_scales(layer), self.g.value_scales(layer)]
                    pages = [v.to_numpy()[g] for v in views]
                else:
                    pages = [a[g * PS:(g + 1) * PS] for a in pool._layer_arrays(layer) if a is not None]
                for got, want in zip(pages, self.ref._layer_arrays(layer)):
                    assert got.tobytes() == want[r * PS:(r + 1) * PS].tobytes(), (g, key.hex()[:8])

    def counts(self):
        for pool in (self.g, self.host) if self.host else (self.g,):
            st = pool.stats
            assert st.free + st.cached + st.in_use == pool.num_pages


PROMPTS = [list(range(100 * i, 100 * i + 9)) for i in range(1, 5)]   # 2 full pages + 1 each


@pytest.mark.parametrize("fmt", ["f16", "int8", "q8_0"])
def test_evicted_pages_go_to_the_host_and_come_back_bit_identical(gpu, fmt):
    t = Tiers(gpu, fmt)
    for prompt in PROMPTS:             # 6 GPU pages: the later prompts take back the earlier
        s, n = t.prefill(prompt)
        assert n == 0
        t.g.free_sequence(s)
        t.counts()
    ts = t.g.tier_stats
    assert ts.demoted >= 2 and ts.dropped == 0
    assert t.host.num_cached_pages == ts.demoted
    s, n = t.g.match_prefix(PROMPTS[0] + [5])   # evicted from the GPU: found on the host
    assert n == 8 and t.g.tier_stats.host_hits == 2 and t.g.tier_stats.gpu_pending == 2
    t.step([s], [[5]], [PROMPTS[0] + [5]])      # the step waits for the copies
    t.ref_prefill(PROMPTS[0] + [5])
    assert t.g.tier_stats.gpu_pending == 0
    t.same_bytes(s)
    t.counts()
    snap = t.g.snapshot(s)                      # the same bytes a reference snapshot has
    r, m = t.ref.match_prefix(PROMPTS[0] + [5, 6])
    ref_snap = t.ref.snapshot(r, 8)
    assert snap.k_codes[:, :8].tobytes() == ref_snap.k_codes.tobytes()
    t.g.free()


def test_a_step_waits_only_for_the_pages_it_touches(gpu):
    """Emulated queued streams: a step of another sequence completes while the copies
    bringing a prefix back are still queued (its event not ready); the prefix's own step
    waits for them."""
    if not gpu.using_emulator():
        pytest.skip("the order of completion is the emulator's proof; a device shows it by timing")
    t = Tiers(gpu, "int8")
    for prompt in PROMPTS:
        t.g.free_sequence(t.prefill(prompt)[0])
    b, _ = t.prefill([1, 2])                         # room left in its page: no page taken
    a, n = t.g.match_prefix(PROMPTS[0] + [5])
    assert n == 8
    ev = t.g._tier.pending[-1][0]
    t.step([b], [[3]], [[1, 2, 3]])                  # compute stream: begin, append, advance
    drv = gpu.driver.cuda()
    with t.g.ctx:
        assert drv.cuEventQuery(ev.handle)[0] == drv.CUresult.CUDA_ERROR_NOT_READY
    t.step([a], [[5]], [PROMPTS[0] + [5]])
    t.ref_prefill(PROMPTS[0] + [5])
    t.same_bytes(a)
    t.g.free()


def test_a_page_in_flight_is_never_read_before_its_copy(gpu, monkeypatch):
    """Attention over a prefix brought back (a step of no new position: no page taken, so
    nothing else orders the step after the copies) equals that over the same positions
    computed in place; with the step's wait for the copies left out (a bug injected), it
    does not: the emulator's queued copy has not run when the kernel reads."""
    if not gpu.using_emulator():
        pytest.skip("on a device the copy may have finished anyway")
    q = dev(gpu, np.random.default_rng(1).standard_normal((1, 4, D)).astype(np.float32))
    new = dev(gpu, np.random.default_rng(2).standard_normal((1, H, D)).astype(np.float32))

    def attend(pool, s, tokens=None):
        """One new position (k = v = `new`) at 7, into the page s holds alone: no page taken."""
        out = gpu.DeviceBuffer.zeros(4 * D * 4).view((1, 4, D), np.float32)
        pool.begin_step([s], [1])
        for layer in range(L):
            pool.append(layer, new, new)
        pool.decode_attention(q, out, 0)
        pool.advance(**({} if tokens is None else {"tokens": tokens}))
        return out.to_numpy()

    outs = []
    for broken in (False, True):
        t = Tiers(gpu, "int8")
        for prompt in PROMPTS:
            t.g.free_sequence(t.prefill(prompt)[0])
        s, n = t.g.match_prefix(PROMPTS[0] + [5])
        assert n == 8 and t.g.tier_stats.gpu_pending == 2
        t.g.truncate(s, 7)
        with monkeypatch.context() as m:
            if broken:
                m.setattr(type(t.g), "_await", lambda self, pages, ready=None: None)
            outs.append(attend(t.g, s, [[5]]))
        t.g.free()
    fresh = gpu.GpuKVPool(spec("int8"), 6, PS, max_batch=1, max_pages_per_seq=8, max_tokens=16)
    f = fresh.new_sequence()             # the same 7 positions, computed in place
    kv = kv_of(PROMPTS[0])[:7]
    keep = [dev(gpu, kv), dev(gpu, -kv)]
    fresh.begin_step([f], [7])
    for layer in range(L):
        fresh.append(layer, keep[0], keep[1])
    fresh.advance()
    want = attend(fresh, f)
    assert np.abs(want).max() > 0
    assert outs[0].tobytes() == want.tobytes()
    assert outs[1].tobytes() != want.tobytes()
    fresh.free()


def never_lies(t):
    """Every key either tier has registered holds the reference's bytes for that key."""
    t.g._settle()
    rt = t.ref._table.prefix.by_key
    for key, g in t.g._table.prefix.by_key.items():
        for layer in range(L):
            got = [t.g.keys(layer).to_numpy()[g], t.g.values(layer).to_numpy()[g]]
            want = t.ref._layer_arrays(layer)
            assert got[0].tobytes() == want[0][rt[key] * PS:(rt[key] + 1) * PS].tobytes()
            assert got[1].tobytes() == want[1][rt[key] * PS:(rt[key] + 1) * PS].tobytes()
    for key, h in t.host._table.prefix.by_key.items() if t.host else ():
        for layer in range(L):
            for got, want in zip(t.host._layer_arrays(layer), t.ref._layer_arrays(layer)):
                if got is not None:
                    assert got[h * PS:(h + 1) * PS].tobytes() == want[rt[key] * PS:(rt[key] + 1) * PS].tobytes()


@pytest.mark.parametrize("where", ["demote, first copy", "demote, second copy", "bring back"])
def test_a_failed_transfer_says_so_and_no_tier_lies(gpu, monkeypatch, where):
    """A copy that fails raises CudaError; when none was queued both pools are as they
    were, else what a queued copy overwrote is dropped; either way every key either tier
    holds keeps its bytes, and the call goes through once the copies work again."""
    t = Tiers(gpu, "q8_0", host_pages=4)
    for prompt in PROMPTS:
        t.g.free_sequence(t.prefill(prompt)[0])

    def state():
        return [(list(x.refs), list(x.free), list(x.prefix.lru), dict(x.prefix.by_key))
                for x in (t.g._table, t.host._table)]

    t.g._settle()
    before = state()
    real, calls = type(t.g)._copy_page, []

    def failing(self, region, page, **kw):
        back = where == "bring back"
        if kw.get("host") is not None and bool(kw.get("to_host")) != back:
            calls.append(page)
            if len(calls) == (len(self._regions()) + 1 if where.endswith("second copy") else 1):
                raise CudaError("cuMemcpy3DAsync: CUDA_ERROR_ILLEGAL_ADDRESS: injected")
        return real(self, region, page, **kw)

    s = t.g.new_sequence() if where != "bring back" else None
    with monkeypatch.context() as m:
        m.setattr(type(t.g), "_copy_page", failing)
        with pytest.raises(CudaError, match="injected"):
            if s is None:
                t.g.match_prefix(PROMPTS[0] + [5])      # its pages are on the host only
            else:
                t.g.begin_step([s], [16])               # 4 pages: takes cached ones back
    if where != "demote, second copy":
        assert state() == before
    never_lies(t)
    if s is None:
        s, n = t.g.match_prefix(PROMPTS[0] + [5])
        assert n == 8
        t.step([s], [[PROMPTS[0][8], 5]], [PROMPTS[0] + [5]])
        t.ref_prefill(PROMPTS[0] + [5])
        t.same_bytes(s)
    else:
        t.step([s], [list(range(16))], [list(range(16))])   # the same step, now through
        t.ref_prefill(list(range(16)))
    never_lies(t)
    t.counts()
    t.g.free()


def test_store_tier_refusals(gpu, tmp_path):
    from kvcore.store import StoreWriter
    store = store_of(tmp_path)
    with pytest.raises(SpecError, match="needs prefix_cache=True"):
        gpu.GpuKVPool(spec(), 6, PS, max_batch=1, max_pages_per_seq=4, store=store)
    with pytest.raises(SpecError, match="store page_size 4 does not match the pool's 8"):
        gpu.GpuKVPool(spec(), 6, 8, max_batch=1, max_pages_per_seq=4, prefix_cache=True,
                      store=store)
    with pytest.raises(SpecError, match="format"):
        gpu.GpuKVPool(spec("f16"), 6, PS, max_batch=1, max_pages_per_seq=4, prefix_cache=True,
                      store=store)
    with pytest.raises(SpecError, match="sliding window"):
        gpu.GpuKVPool(spec(), 6, PS, max_batch=1, max_pages_per_seq=4, prefix_cache=True,
                      store=store, window=8)
    with StoreWriter(store) as writer, pytest.raises(SpecError, match="store_writer= needs a pool without a window"):
        gpu.GpuKVPool(spec(), 6, PS, max_batch=1, max_pages_per_seq=4, prefix_cache=True,
                      store=store, store_writer=writer, window=8)


def test_host_tier_refusals(gpu):
    bad = [(KVPool(spec("f16"), 8, PS, prefix_cache=True), {}, "format"),
           (KVPool(spec("int8"), 8, 8, prefix_cache=True), {}, "page_size"),
           (KVPool(spec("int8"), 8, PS), {}, "prefix_cache=True on both"),
           (KVPool(spec("int8"), 8, PS, prefix_cache=True), {"prefix_cache": False}, "prefix_cache=True"),
           ("pool", {}, "host must be a kvcore.KVPool, got str")]
    for host, kw, match in bad:
        with pytest.raises(SpecError, match=match):
            gpu.GpuKVPool(spec("int8"), 6, PS, max_batch=1, max_pages_per_seq=4,
                          **{"prefix_cache": True, **kw}, host=host)



def test_the_host_tier_is_page_locked_while_attached(gpu):
    from cuda.bindings import driver as drv
    t = Tiers(gpu)
    ptr = t.host._storage.ctypes.data

    def locked():
        return drv.cuMemHostGetFlags(ptr)[0] == drv.CUresult.CUDA_SUCCESS
    assert locked()
    used = t.g.ctx.live_bytes
    with pytest.raises(StateError, match="page-locked already"):   # one GPU pool per host
        gpu.GpuKVPool(spec(), 6, PS, max_batch=1, max_pages_per_seq=4, prefix_cache=True,
                      host=t.host)
    assert t.g.ctx.live_bytes == used        # the refused pool left no device memory
    for start in (0, 100, 200):              # demotions: copies into the locked pages
        s, _ = t.prefill(list(range(start, start + 12)))
        t.g.free_sequence(s)
    s, n = t.prefill(list(range(12)))       # ... and back
    assert n == 8 and t.g.tier_stats.demoted and t.g.tier_stats.host_hits == 2
    t.same_bytes(s)
    t.g.free()
    assert not locked()



# ------------------------------------------------------------------ the store tier

C = 2 * PS   # positions per stored chunk


def store_of(tmp_path, fmt="int8"):
    from kvcore.store import DirectoryBackend, KVStore
    return KVStore(DirectoryBackend(tmp_path), model="m", spec=spec(fmt), chunk_tokens=C,
                   page_size=PS)


@pytest.mark.parametrize("fmt", ["bf16", "q8_0"])
def test_chunks_go_to_the_store_and_come_back_through_any_pool(gpu, tmp_path, fmt):
    """A GPU pool saves the chunks its steps complete (copied out on the transfer stream,
    submitted once copied); a CPU pool finds them under the same keys, and a GPU pool
    finds a CPU pool's, bit for bit."""
    from kvcore.store import StoreWriter
    store = store_of(tmp_path, fmt)
    with StoreWriter(store) as writer:
        t = Tiers(gpu, fmt, host_pages=0, store=store, store_writer=writer)
        s, _ = t.prefill(PROMPTS[0] + PROMPTS[1][:8])   # 17 positions: 2 chunks
        t.g.free()                                      # submits the copied chunks
    assert writer.stats.chunks_written == 2 and writer.stats.failed == 0
    cpu = KVPool(spec(fmt), 16, PS, prefix_cache=True, store=store)
    c, n = cpu.match_prefix(PROMPTS[0] + PROMPTS[1][:8] + [7])
    assert n == 2 * C and cpu.stats.store_hits == 4
    t.same_bytes(c, cpu)

    with StoreWriter(store) as writer:                  # and the other way
        cpu = KVPool(spec(fmt), 16, PS, prefix_cache=True, store=store, store_writer=writer)
        c, _ = cpu.match_prefix(PROMPTS[2])
        kv = kv_of(PROMPTS[2])
        for layer in range(L):
            cpu.append(kv, -kv, seq=c, layer=layer)
        cpu.advance(c, tokens=PROMPTS[2])
    t.ref_prefill(PROMPTS[2])
    t2 = Tiers(gpu, fmt, host_pages=0, store=store)
    t2.ref = t.ref
    s, n = t2.g.match_prefix(PROMPTS[2] + [5])
    assert n == C and t2.g.stats.store_hits == 2 and t2.g.tier_stats.gpu_pending == 2
    t2.step([s], [PROMPTS[2][C:] + [5]], [PROMPTS[2] + [5]])
    t2.same_bytes(s)
    t2.g.free()


def test_three_tiers_and_a_corrupt_chunk(gpu, tmp_path):
    """Pages leave the GPU for the host and the host for good; the store still has them:
    a lookup goes GPU -> host -> store. A corrupt stored value is a counted fault (the
    lookup stops there), never an exception."""
    from kvcore.store import StoreWriter
    store = store_of(tmp_path)
    with StoreWriter(store) as writer:
        t = Tiers(gpu, "int8", host_pages=2, store=store, store_writer=writer)
        for prompt in PROMPTS:
            t.g.free_sequence(t.prefill(prompt)[0])
        t.g._settle()
        writer.flush()
        assert writer.stats.chunks_written == len(PROMPTS)
        assert t.host.stats.evictions > 0             # the host was too small for them all
        s, n = t.g.match_prefix(PROMPTS[0] + [5])
        assert n == 8 and t.g.stats.store_faults == 0   # page 0 on the host, 1 in the store
        assert t.g.tier_stats.host_hits == 1 and t.g.stats.store_hits == 1
        t.step([s], [[PROMPTS[0][8], 5]], [PROMPTS[0] + [5]])
        t.ref_prefill(PROMPTS[0] + [5])
        t.same_bytes(s)
        t.g.free_sequence(s)
        t.counts()
        path = store.backend._path(store.keys(PROMPTS[1])[0])
        with open(path, "r+b") as f:
            f.seek(-3, 2)
            f.write(b"bad")
        for prompt in PROMPTS[2:]:                    # PROMPTS[1] leaves the GPU again
            t.g.free_sequence(t.prefill(prompt)[0])
        s, n = t.g.match_prefix(PROMPTS[1] + [5])
        assert n < 8 and t.g.stats.store_faults == 1 and t.g.stats.last_store_fault
        t.counts()
        t.g.free()


@pytest.mark.parametrize("way", ["in", "in, midway", "out"])
def test_a_failed_store_copy_says_so_and_changes_nothing(gpu, tmp_path, monkeypatch, way):
    """A copy in from the store that fails raises CudaError with the GPU table as it was
    (no sequence made; midway, after a chunk's first copies were queued: only the cached
    pages they overwrote are dropped); a copy out that fails is a counted store fault of
    a committed step (advance does not raise after committing). Either way the pool goes
    on."""
    from kvcore.gpu import driver
    from kvcore.store import StoreWriter
    store = store_of(tmp_path)
    with StoreWriter(store) as writer:
        t = Tiers(gpu, "int8", host_pages=0, store=store, store_writer=writer)
        for prompt in PROMPTS[:2]:
            t.g.free_sequence(t.prefill(prompt)[0])
        t.g._settle()
        writer.flush()
        for prompt in PROMPTS[2:]:                    # PROMPTS[0] leaves the GPU
            t.g.free_sequence(t.prefill(prompt)[0])
        real = type(t.g)._copy_run

        def failing(self, *args, to_host, **kw):
            if to_host == (way == "out"):
                raise CudaError("cuMemcpyHtoDAsync: CUDA_ERROR_ILLEGAL_ADDRESS: injected")
            return real(self, *args, to_host=to_host, **kw)

        real_call, copies = driver.call, []

        def failing_midway(name, *args):      # the second copy into pages 2, 3 (one run)
            copies.append(name)
            if name == "cuMemcpyHtoDAsync" and copies.count(name) == 2:
                raise CudaError("cuMemcpyHtoDAsync: CUDA_ERROR_ILLEGAL_ADDRESS: injected")
            return real_call(name, *args)

        table = t.g._table
        before = (list(table.refs), list(table.free), list(table.prefix.lru),
                  dict(table.prefix.by_key), sorted(table.seqs))
        with monkeypatch.context() as m:
            if way == "in, midway":
                assert table.free == [3] and list(table.prefix.lru)[0] == 2  # it takes 2, 3
                m.setattr(driver, "call", failing_midway)
                with pytest.raises(CudaError, match="injected"):
                    t.g.match_prefix(PROMPTS[0] + [5])
                assert sorted(table.seqs) == before[-1] and table.prefix.by_key != before[3]
                never_lies(t)
            m.setattr(type(t.g), "_copy_run", failing)
            if way == "in":
                with pytest.raises(CudaError, match="injected"):
                    t.g.match_prefix(PROMPTS[0] + [5])
                assert (list(table.refs), list(table.free), list(table.prefix.lru),
                        dict(table.prefix.by_key), sorted(table.seqs)) == before
            elif way == "out":
                s, _ = t.prefill(list(range(500, 510)))    # a chunk completes: not saved
                assert t.g.stats.store_faults == 1
                assert "copy out to the store failed" in t.g.stats.last_store_fault
                assert t.g.length(s) == 10
                t.g.free_sequence(s)
                t.g._settle()
                writer.flush()
                assert store.lookup(list(range(500, 510))) == 0
        s, n = t.g.match_prefix(PROMPTS[0] + [5])       # and now it goes through
        assert n == 8
        t.step([s], [[PROMPTS[0][8], 5]], [PROMPTS[0] + [5]])
        t.ref_prefill(PROMPTS[0] + [5])
        t.same_bytes(s)
        t.g.free()


def test_a_page_is_not_reused_before_its_copy_to_the_store(gpu, tmp_path, monkeypatch):
    """Emulated queued streams, copies never seen done when asked (a slow transfer): a
    chunk's copy out waits on the transfer stream while the next step takes its pages
    back; the step waits for it, and the store gets the chunk's bytes. With that wait left
    out (a bug injected) the stored chunk holds the new step's."""
    if not gpu.using_emulator():
        pytest.skip("on a device the copy may have finished anyway")
    from kvcore.store import StoreWriter
    got = []
    monkeypatch.setattr(gpu.driver.Event, "done", lambda self: False)
    for broken in (False, True):
        store = store_of(tmp_path / str(broken))
        with StoreWriter(store) as writer:
            t = Tiers(gpu, "int8", pages=2, host_pages=0, store=store, store_writer=writer)
            s, _ = t.prefill(PROMPTS[0][:8])           # one chunk: its 2 pages, copied out
            t.g.free_sequence(s)
            real = type(t.g)._await
            with monkeypatch.context() as m:
                if broken:
                    m.setattr(type(t.g), "_await", lambda self, pages, ready=None:
                              None if ready is not None else real(self, pages))
                s, _ = t.prefill(PROMPTS[1][:8])       # takes both pages back
            t.g.free()
        cpu = KVPool(spec("int8"), 4, PS, prefix_cache=True, store=store)
        c, n = cpu.match_prefix(PROMPTS[0][:8] + [1])
        assert n == 8
        try:
            t.same_bytes(c, cpu)
            got.append(True)
        except AssertionError:
            got.append(False)
    assert got == [True, False]


# ------------------------------------------------------------------ a hostile sequence of calls

from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

# prompts over a few shared starts of 3 pages: hits on either tier, misses, evictions
STARTS = [list(range(1000 + 20 * i, 1000 + 20 * i + 12)) for i in range(4)]


class TierMachine(RuleBasedStateMachine):
    """Prefills (match_prefix, then a step), decode steps and frees on a GpuKVPool of 6
    pages over a host pool of 2 and a store. After every call: each live sequence reads
    back (snapshot, which waits for its copies) the reference's K/V of its tokens; every
    key either pool holds keeps its bytes once the copies ran; free + cached + in use =
    pages, per pool; at the end every chunk the store holds has the reference's bytes."""

    gpu = None

    def __init__(self):
        super().__init__()
        from kvcore.store import StoreWriter
        self.dir = tempfile.mkdtemp()
        self.store = store_of(pathlib.Path(self.dir))
        self.writer = StoreWriter(self.store)
        self.t = Tiers(self.gpu, "int8", pages=6, host_pages=2, store=self.store,
                       store_writer=self.writer)
        self.live: dict[int, list[int]] = {}     # sequence -> its tokens

    @rule(start=st.integers(0, 3), cut=st.integers(2, 12), tail=st.lists(st.integers(0, 9), max_size=3),
          keep=st.booleans())
    def prefill(self, start, cut, tail, keep):
        tokens = STARTS[start][:cut] + tail
        if not keep:                             # the serving loop: the last one finished
            for s in list(self.live):
                self.t.g.free_sequence(s)
                del self.live[s]
        try:
            s, n = self.t.prefill(tokens)
        except CapacityError:
            return                               # the GPU is full of live sequences
        assert n % PS == 0 and n <= len(tokens) - 1
        self.live[s] = tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data):
        s = data.draw(st.sampled_from(sorted(self.live)))
        tokens = self.live[s] + [7]
        try:
            self.t.step([s], [[7]], [tokens])
        except CapacityError:
            return
        self.t.ref_prefill(tokens)
        self.live[s] = tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.live)))
        self.t.g.free_sequence(s)
        del self.live[s]

    @invariant()
    def every_sequence_reads_its_tokens(self):
        for s, tokens in self.live.items():
            snap = self.t.g.snapshot(s)
            r, m = self.t.ref.match_prefix(tokens + [0])
            assert m >= len(tokens) - len(tokens) % PS
            want = self.t.ref.snapshot(r, m)
            self.t.ref.free(r)
            assert snap.k_codes[:, :m].tobytes() == want.k_codes.tobytes()
            assert snap.v_codes[:, :m].tobytes() == want.v_codes.tobytes()
        self.t.counts()

    def teardown(self):
        never_lies(self.t)
        self.t.g.free()
        self.writer.close()
        cpu = KVPool(spec("int8"), 16, PS, prefix_cache=True, store=self.store)
        for start in STARTS:
            c, _ = cpu.match_prefix(start + [0])
            self.t.same_bytes(c, cpu)
            cpu.free(c)
        shutil.rmtree(self.dir)


def test_tiers_under_a_hostile_sequence_of_calls(gpu):
    TierMachine.gpu = gpu
    run = TierMachine.TestCase
    run.settings = settings(max_examples=8, stateful_step_count=14, deadline=None, derandomize=True,
                            database=None,
                            suppress_health_check=list(HealthCheck))
    run().runTest()
