"""The prefix cache of a GpuKVPool, on a device or under the emulator: the CPU KVPool's
bookkeeping (PageTable, PrefixIndex), so the same calls give the same pages, keys, hits,
evictions and bytes on both, also under a hypothesis machine of prefills, decode steps,
forks, truncations and frees with the CPU pool as the oracle; a hit reads back exactly
what recomputing the prompt writes; a graph captured once replays over a sequence found
in the cache."""
import numpy as np
import pytest

from kvcore import CapacityError, KVPool, KVSpec, ShapeError, StateError
from kvcore.gpu.cache import GPU_FORMATS

from test_gpu_pool import captured, dev
from test_prefix import kv_of as prefix_kv_of

pytestmark = pytest.mark.gpu

L, H, D, PS = 2, 2, 64, 4


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


def spec(fmt):
    return KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=64, num_heads=4, format=fmt)


def kv_of(tokens, extra=None):
    """K/V [T, H, D] of each position (test_prefix.kv_of at this file's sizes)."""
    return prefix_kv_of(tokens, extra, H, D)


class Pair:
    """A GpuKVPool and a CPU KVPool with a prefix cache, driven by the same calls."""

    def __init__(self, gpu, fmt, pages=12, **kw):
        self.gpu = gpu
        self.g = gpu.GpuKVPool(spec(fmt), pages, PS, max_batch=2, max_pages_per_seq=8,
                               max_tokens=32, prefix_cache=True, **kw)
        self.c = KVPool(spec(fmt), pages, PS, prefix_cache=True)
        self.keep = []

    def prefill(self, tokens, extra=None):
        """match_prefix on both, then compute and commit the rest in one step."""
        got = self.g.match_prefix(tokens, extra=extra)
        assert got == self.c.match_prefix(tokens, extra=extra)
        s, n = got
        self.step([s], [tokens[n:]], extra)
        return s, n

    def step(self, seqs, token_lists, extra=None):
        counts = [len(t) for t in token_lists]
        self.g.begin_step(seqs, counts)
        kv = np.concatenate([kv_of(self.full(s, t), extra)[-len(t):] for s, t in zip(seqs, token_lists)])
        for layer in range(L):
            self.keep += [dev(self.gpu, kv), dev(self.gpu, -kv)]
            self.g.append(layer, self.keep[-2], self.keep[-1])
            self.c.append_batch(kv, -kv, seqs=seqs, layer=layer, counts=counts)
        assert self.g.advance(tokens=token_lists) == counts
        self.c.advance(seqs, tokens=token_lists)

    def full(self, s, new):
        """The ids of s's committed positions (the CPU pool's record; a restored sequence
        has none: zeros in their place), then `new`."""
        seq = self.c._table.get(s)
        if seq.ids is None:
            return [0] * seq.length + list(new)
        return list(np.frombuffer(bytes(seq.ids), "<i8")) + list(new)

    def same(self):
        """Same tables, cache index and counters; every held page the same bytes."""
        gt, ct = self.g._table, self.c._table
        assert gt.refs == ct.refs and gt.free == ct.free
        assert list(gt.prefix.lru) == list(ct.prefix.lru)
        assert gt.prefix.by_key == ct.prefix.by_key       # the same content keys
        assert self.g.stats == self.c.stats
        st = self.g.stats
        assert st.free + st.cached + st.in_use == self.g.num_pages
        for s in self.c.sequences:
            rows = np.array(ct.rows(s, 0, self.c.length(s)), np.int64)
            for layer in range(L):
                sp = self.g.spec
                views = [self.g.keys(layer), self.g.values(layer),
                         self.g.key_scales(layer) if sp.k_fmt.quantized else None,
                         self.g.value_scales(layer) if sp.v_fmt.quantized else None]
                for v, want in zip(views, self.c._layer_arrays(layer)):
                    if v is None:                  # a side without scales
                        assert want is None
                        continue
                    got = v.to_numpy().reshape((-1,) + v.shape[2:])[rows]
                    assert got.tobytes() == want[rows].tobytes()


@pytest.mark.parametrize("fmt", GPU_FORMATS)
def test_hits_evictions_and_keys_equal_the_cpu_pool(gpu, fmt):
    p = Pair(gpu, fmt)
    prompt = list(range(100, 111))                          # 11 tokens: 2 full pages + 3
    a, n = p.prefill(prompt)
    assert n == 0
    p.g.free_sequence(a), p.c.free(a)                       # 2 registered pages stay cached
    p.same()
    assert p.g.num_cached_pages == 2
    b, n = p.prefill(prompt + [7, 8])                       # hits both pages
    assert n == 8 and p.g.stats.hits == 2
    c, n = p.prefill(prompt[:9] + [5, 5, 5])                # shares b's pages: 2 hits more
    assert n == 8
    assert p.g.page_table(c)[:2].tolist() == p.g.page_table(b)[:2].tolist()
    p.same()
    other, n = p.prefill(list(range(500, 509)), extra={"adapter": "x"})   # another prefix
    assert n == 0
    p.same()
    for s in (b, c, other):
        p.g.free_sequence(s), p.c.free(s)
    p.same()
    # a long prompt takes cached pages back, least recently used leaf first
    big, n = p.prefill(list(range(900, 932)))    # 8 pages: 4 free, 4 taken back
    assert n == 0 and p.g.stats.evictions > 0
    p.same()
    # what was evicted is gone from both: the lookup misses alike
    again = p.g.match_prefix(prompt)
    assert again == p.c.match_prefix(prompt)
    p.same()
    p.g.free()


def test_a_hit_reads_exactly_what_recomputing_writes(gpu):
    """Decode attention over a sequence found in the cache equals, bit for bit, the same
    over a pool that computed the whole prompt (other page ids, the same bytes)."""
    p = Pair(gpu, "q8_0")
    prompt = list(range(40, 53))
    a, _ = p.prefill(prompt)
    p.g.free_sequence(a), p.c.free(a)
    s, n = p.prefill(prompt + [1])
    assert n == 12
    fresh = gpu.GpuKVPool(spec("q8_0"), 12, PS, max_batch=2, max_pages_per_seq=8, max_tokens=14)
    other, t = fresh.new_sequence(), fresh.new_sequence()   # other takes the first pages
    fresh.begin_step([other, t], [5, len(prompt) + 1])
    kv = np.concatenate([kv_of(list(range(5))), kv_of(prompt + [1])])
    keep = []
    for layer in range(L):
        keep += [dev(gpu, kv), dev(gpu, -kv)]
        fresh.append(layer, keep[-2], keep[-1])
    fresh.advance()
    q = dev(gpu, np.random.default_rng(5).standard_normal((1, 4, D)).astype(np.float32))
    new = dev(gpu, np.random.default_rng(6).standard_normal((1, H, D)).astype(np.float32))
    outs = [gpu.DeviceBuffer.zeros(4 * D * 4).view((1, 4, D), np.float32) for _ in range(2)]
    for pool, seq, out in ((p.g, s, outs[0]), (fresh, t, outs[1])):
        pool.begin_step([seq], [1])               # one more position, the same on both
        for layer in range(L):
            pool.append(layer, new, new)
        pool.decode_attention(q, out, 1)
        pool.advance(**({"tokens": [[2]]} if pool is p.g else {}))
    assert np.abs(outs[0].to_numpy()).max() > 0
    assert outs[0].to_numpy().tobytes() == outs[1].to_numpy().tobytes()
    assert p.g.page_table(s)[:3].tolist() != fresh.page_table(t)[:3].tolist()
    p.g.free(), fresh.free()


@pytest.mark.parametrize("over", [False, True])
def test_a_restored_sequence_is_never_registered(gpu, over):
    """A snapshot carries no token ids: the pages a restored sequence fills later stay out
    of the cache on both pools, restored as a new sequence or over a keyed one (the GPU
    pool had kept the ids of the sequence it restored over, and its empty ids for a new
    one, and registered its next pages under keys its tokens did not name)."""
    p = Pair(gpu, "q8_0")
    a, _ = p.prefill(list(range(100, 109)))                 # 2 pages registered
    keys = dict(p.c._table.prefix.by_key)
    snap = p.c.snapshot(a, 5)
    target = p.prefill(list(range(200, 203)))[0] if over else None
    s = p.g.restore(snap, seq=target)
    assert s == p.c.restore(snap, seq=target)
    p.step([s], [[7] * 7])                                 # fills pages 1 and 2
    assert p.g._table.prefix.by_key == keys
    p.same()
    assert p.g.match_prefix([7] * 12) == p.c.match_prefix([7] * 12)
    p.g.free()


def test_tokens_refused_before_the_step_ends(gpu):
    p = Pair(gpu, "f16")
    s = p.g.new_sequence()
    p.c.new_sequence()
    p.g.begin_step([s], [3])
    kv = dev(gpu, kv_of([1, 2, 3]))
    for layer in range(L):
        p.g.append(layer, kv, kv)
    with pytest.raises(StateError, match="needs the token ids of its 3 new positions"):
        p.g.advance()
    with pytest.raises(ShapeError, match="invalid tokens of sequence 0: expected 3 ids"):
        p.g.advance(tokens=[[1, 2]])
    with pytest.raises(ShapeError, match="expected 1 id arrays"):
        p.g.advance(tokens=[[1, 2, 3], [4]])
    assert p.g.advance(tokens=[[1, 2, 3]]) == [3]             # the step stayed open
    plain = gpu.GpuKVPool(spec("f16"), 4, PS, max_batch=1, max_pages_per_seq=4)
    with pytest.raises(StateError, match="match_prefix needs a pool made with prefix_cache=True"):
        plain.match_prefix([1, 2, 3])
    t = plain.new_sequence()
    plain.begin_step([t], [0])
    with pytest.raises(StateError, match="no prefix cache"):
        plain.advance(tokens=[[]])
    plain.advance()
    plain.free(), p.g.free()


def test_a_captured_graph_replays_over_a_cached_prefix(gpu, monkeypatch):
    """append + decode_attention captured once; between replays a sequence starts on the
    cached pages of one prompt or another (new block tables, written in place by
    begin_step): the replay equals an eager run, bit for bit. With the table write left
    out (a stale table injected), it does not."""
    p, eager = Pair(gpu, "int8"), Pair(gpu, "int8")
    prompts = [list(range(60, 69)), list(range(70, 79))]
    for pair in (p, eager):
        for prompt in prompts:
            a, _ = pair.prefill(prompt)
            pair.g.free_sequence(a), pair.c.free(a)
    x = gpu.DeviceBuffer.alloc(2 * 2 * H * D * 4)
    k, v = (x.view((2, H, D), np.float32, offset=i * 2 * H * D * 4) for i in range(2))
    qo = gpu.DeviceBuffer.zeros(3 * 2 * 4 * D * 4)
    q, out, ref = (qo.view((2, 4, D), np.float32, offset=i * 2 * 4 * D * 4) for i in range(3))
    with captured(gpu, p.g.stream) as made:
        p.g.append(0, k, v)
        p.g.decode_attention(q, out, 0)
    rng = np.random.default_rng(3)

    def run(tokens, stale=False):
        """A sequence on the 2 cached pages of tokens[:8], 2 new positions: replay vs eager."""
        (s, n), (t, m) = (pair.g.match_prefix(tokens) for pair in (p, eager))
        assert n == m == 8
        x.copy_from_host(rng.standard_normal((2, 2, H, D)).astype(np.float32))
        qo.copy_from_host(rng.standard_normal((3, 2, 4, D)).astype(np.float32))
        with monkeypatch.context() as m:
            if stale:    # a begin_step whose table write never reaches the device
                m.setattr(type(p.g._meta), "copy_from_host", lambda *a, **kw: None)
            p.g.begin_step([s], [2])
        eager.g.begin_step([t], [2])
        with p.g.stream.ctx:
            gpu.driver.call("cuGraphLaunch", made[0], p.g.stream.handle)
        eager.g.append(0, k, v)
        eager.g.decode_attention(q, ref, 0)
        for pool in (p.g, eager.g):
            pool.advance(tokens=[tokens[8:]])
        return out.to_numpy().tobytes() == ref.to_numpy().tobytes()

    assert run(prompts[0][:8] + [3, 3])
    assert run(prompts[1][:8] + [9, 9])
    assert not run(prompts[0][:8] + [4, 4], stale=True)   # it read prompt 1's pages
    with p.g.stream.ctx:
        gpu.driver.call("cuGraphExecDestroy", made[0])
        gpu.driver.call("cuGraphDestroy", made[1])
    x.free(), qo.free()
    p.g.free(), eager.g.free()


# ------------------------------------------------------------------ a hostile sequence of calls

from hypothesis import HealthCheck, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

# prompts over a few shared starts of 3 pages, with and without extras
STARTS = [list(range(1000 + 20 * i, 1000 + 20 * i + 12)) for i in range(3)]


class PairRules(RuleBasedStateMachine):
    """What a machine of a GpuKVPool (`g`) and the CPU KVPool beside it (`c`, the oracle)
    shares, over its live sequences (`live`, at most MAX_LIVE): `both`, and the fork and
    free rules (test_gpu_groups_machine's machine is one too)."""

    MAX_LIVE = 1 << 30

    def both(self, call, *args):
        """call(pool, *args) on both pools: the same result, or the same error type."""
        out = []
        for pool in (self.g, self.c):
            try:
                out.append(("ok", call(pool, *args)))
            except (CapacityError, StateError, ShapeError) as e:
                out.append((type(e), None))
        assert out[0] == out[1], out
        return out[0]

    @precondition(lambda self: self.live and len(self.live) < self.MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data):
        s = data.draw(st.sampled_from(self.live))
        got = self.both(lambda pool: pool.fork(s))
        if got[0] == "ok":
            self.live.append(got[1])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.live))
        self.g.free_sequence(s)
        self.c.free(s)
        self.live.remove(s)


class PairMachine(PairRules):
    """The prefix cache's calls (prefills through match_prefix, decode steps of several
    sequences, forks, truncations, frees, failing steps) on a GpuKVPool of 10 pages and on
    the CPU KVPool beside it, the oracle: after every call the same page tables, free
    list, LRU, keys and counters, and every held page the same bytes (`Pair.same`); a call
    one refuses the other refuses too, changing nothing. Subclassed per format and K/V pair
    (fmt): a side without scales is compared as such."""

    gpu = None
    fmt = "q8_0"

    def __init__(self):
        super().__init__()
        self.p = Pair(self.gpu, self.fmt, pages=10)
        self.g, self.c = self.p.g, self.p.c
        self.live: list[int] = []

    @rule(start=st.integers(0, 2), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 9), max_size=3),
          extra=st.sampled_from([None, {"adapter": "x"}]))
    def prefill(self, start, cut, tail, extra):
        tokens = STARTS[start][:cut] + tail
        got = self.both(lambda pool: pool.match_prefix(tokens, extra=extra))
        if got[0] != "ok":
            return
        s, n = got[1]
        self.live.append(s)
        if n < len(tokens):
            self.step_or_refuse([s], [tokens[n:]], extra)

    def step_or_refuse(self, seqs, token_lists, extra=None):
        """One step on both; a step the GPU pool refuses at begin_step (no free page) must
        be refused by the CPU pool's writes too, and leaves both tables as they were."""
        counts = [len(t) for t in token_lists]
        try:
            self.p.g.begin_step(seqs, counts)
        except CapacityError:
            kv = np.zeros((sum(counts), H, D), np.float32)
            with pytest.raises(CapacityError):
                self.p.c.append_batch(kv, kv, seqs=seqs, layer=0, counts=counts)
            return
        kv = np.concatenate([kv_of(self.p.full(s, t), extra)[-len(t):] for s, t in zip(seqs, token_lists)])
        for layer in range(L):
            self.p.keep += [dev(self.gpu, kv), dev(self.gpu, -kv)]
            self.p.g.append(layer, self.p.keep[-2], self.p.keep[-1])
            self.p.c.append_batch(kv, -kv, seqs=seqs, layer=layer, counts=counts)
        assert self.p.g.advance(tokens=token_lists) == counts
        self.p.c.advance(seqs, tokens=token_lists)
        self.p.keep.clear()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 9), min_size=1, max_size=2))
    def decode(self, data, tokens):
        seqs = data.draw(st.lists(st.sampled_from(self.live), min_size=1, max_size=2, unique=True))
        extras = {s: self.p.c._table.get(s).extra for s in seqs}
        if len(set(extras.values())) > 1:
            return                                 # kv_of takes one extra per step here
        extra = next(iter(extras.values()))
        self.step_or_refuse(seqs, [tokens] * len(seqs), {"adapter": "x"} if extra else None)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), back=st.integers(0, 6))
    def truncate(self, data, back):
        s = data.draw(st.sampled_from(self.live))
        n = max(0, self.p.c.length(s) - back)
        self.both(lambda pool: pool.truncate(s, n))

    @invariant()
    def the_same_on_both(self):
        self.p.same()

    def teardown(self):
        self.p.g.free()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q8_0/q4_0", "f16/q4_0"])
def test_the_gpu_pool_keeps_the_cpu_pools_books_under_a_hostile_sequence_of_calls(gpu, fmt):
    machine = type(f"PairMachine_{fmt.replace('/', '_')}", (PairMachine,), {"gpu": gpu, "fmt": fmt})
    run = machine.TestCase
    run.settings = settings(max_examples=20, stateful_step_count=25, deadline=None, derandomize=True,
                            database=None, suppress_health_check=list(HealthCheck))
    run().runTest()
