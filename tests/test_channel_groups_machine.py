"""Nothing is lost with K in q4_1ch: hypothesis state machines drive KVCaches and KVPools
whose K is stored by channel over groups of 32 positions (V per token, in q4_1 or q4_0)
with random appends of up to 40 positions, advance, truncate (into encoded groups too),
reset, snapshot and restore (through a file too) and refused calls, against a numpy model:
per layer the float16 K each position holds (K is rounded to float16 on append; a
truncation into an encoded group leaves its kept positions holding their decoded values,
rounded to float16), each complete group's codes and scales (kvcore.quantize of its
float16 K, one head at a time), and V's codes and scales per position.

After every step: the lengths; the codes and scales of every complete group, byte for
byte; K and V as `dequantize` decodes them, committed and pending, bit for bit. After
every refused call: the storage, the residual and the lengths are as they were. A rule
compares decode attention (the grouped kernel) with a float64 reference over the model's
values.

The pool machines run the same contract over KVPools (PoolGroupsMachine: sequences,
fork, free, snapshots into new or existing sequences); WindowGroupsMachine adds a
sliding window (with and without a sink page) whose pages leave group by group, and
PrefixGroupsMachine a prefix cache whose pages (one group each) are matched, freed into
the cache and evicted, StorePrefixGroupsMachine a chunk store behind that cache (loads
and restarts). Their docstrings list what each adds.

Examples per machine: KVCORE_STATE_EXAMPLES (default 100, the CI budget: 2-5 s each),
steps per example: KVCORE_STATE_STEPS (default 30).
"""
import copy
import hashlib
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant,
                                 multiple, precondition, rule)

import kvcore
from kvcore import KVCache, KVPool, KVSpec, load_snapshot
from kvcore.errors import (CapacityError, FormatError, NonFiniteError, OutOfRangeError,
                           ShapeError, StateError)
from kvcore._prefix_keys import encode_extra, prefix_keys
from kvcore._quant import input_limit

from _machines import WindowBooks, machine_test, one_thread  # noqa: F401  (one_thread: autouse)

EXAMPLES = int(os.environ.get("KVCORE_STATE_EXAMPLES", "100"))
STEPS = int(os.environ.get("KVCORE_STATE_STEPS", "30"))
L, H, D, N, G = 2, 2, 32, 80, 32      # capacity N: two complete groups and an open one
HQ = 2 * H
F16, F32 = np.float16, np.float32


def decode_group(codes, scales):
    """float32 [G, H, D]: a complete group's K from its codes [G, H, D/2] and scales."""
    return kvcore.dequantize(codes.swapaxes(0, 1), scales.swapaxes(0, 1), "q4_1ch").swapaxes(0, 1)


class Model:
    """The cache as plain numpy (module comment)."""

    def __init__(self, vfmt, n=N):
        """n: the capacity (positions). A pool's sequence also keeps its token ids (those
        of its pending positions included), the extras it is keyed under, whether it is
        keyed (a restore carries no ids) and its first held position past the sink pages
        (a window's: `start`)."""
        self.vfmt = kvcore.formats.FORMATS[vfmt]
        self.k16 = np.zeros((L, n, H, D), F16)
        self.kc = np.zeros((L, n, H, D // 2), np.uint8)
        self.ks = np.zeros((L, n, H, D // 16), F16)
        self.vc = np.zeros((L, n, H, self.vfmt.code_width(D)), self.vfmt.code_dtype)
        self.vs = np.zeros((L, n, H, self.vfmt.scales_per_row(D)), self.vfmt.scale_dtype)
        self.length, self.pending = 0, [0] * L
        self.ids, self.extra, self.keyed, self.start = [], None, True, 0

    def end(self, layer):
        return self.length + self.pending[layer]

    def k(self, layer, end):
        """float32 [end, H, D]: K of positions [0, end) as the cache decodes them."""
        out = self.k16[layer, :end].astype(F32)
        for a in range(0, end - end % G, G):
            out[a:a + G] = decode_group(self.kc[layer, a:a + G], self.ks[layer, a:a + G])
        return out

    def v(self, layer, end):
        return kvcore.dequantize(self.vc[layer, :end], self.vs[layer, :end], self.vfmt)

    def append(self, layer, k, v):
        pos, t = self.end(layer), len(k)
        self.k16[layer, pos:pos + t] = k.astype(F32).astype(F16)
        for a in range(pos - pos % G, pos + t - G + 1, G):     # the groups it completes
            c, s = kvcore.quantize(self.k16[layer, a:a + G].swapaxes(0, 1), "q4_1ch")
            self.kc[layer, a:a + G], self.ks[layer, a:a + G] = c.swapaxes(0, 1), s.swapaxes(0, 1)
        c, s = kvcore.quantize(v.astype(F32), self.vfmt)
        self.vc[layer, pos:pos + t], self.vs[layer, pos:pos + t] = c.view(self.vfmt.code_dtype), s
        self.pending[layer] += t

    def open_values(self, layer, n):
        """float16 [n % G, H, D]: K of the open group of [0, n) (n <= the layer's end):
        held as written, or decoded when the layer has completed that group."""
        a = n - n % G
        if a + G <= self.end(layer):
            return decode_group(self.kc[layer, a:a + G], self.ks[layer, a:a + G])[:n - a].astype(F16)
        return self.k16[layer, a:n].copy()

    def truncate(self, n):
        a = n - n % G
        for layer in range(L):
            self.k16[layer, a:n] = self.open_values(layer, n)
        self.length, self.pending = n, [0] * L
        del self.ids[n:]

    def state(self, n):
        """What a snapshot of [0, n) holds (copies)."""
        return {"kc": self.kc[:, :n].copy(), "ks": self.ks[:, :n].copy(),
                "vc": self.vc[:, :n].copy(), "vs": self.vs[:, :n].copy(),
                "open": [self.open_values(layer, n) for layer in range(L)], "n": n,
                "ids": self.ids[:n]}

    def restore(self, st_):
        n = st_["n"]
        for name in ("kc", "ks", "vc", "vs"):
            getattr(self, name)[:, :n] = st_[name]
        for layer in range(L):
            self.k16[layer, n - n % G:n] = st_["open"][layer]
        self.length, self.pending, self.ids = n, [0] * L, list(st_["ids"])


def reference(q, k, v, window=None, sinks=0):
    """float64 causal attention of q [T, HQ, D] (the last T positions' queries) over k, v
    [n, H, D]; with a window W the query at p sees p - W < j <= p and j < sinks."""
    T, n = len(q), len(k)
    qg = q.astype(np.float64).reshape(T, H, HQ // H, D) / np.sqrt(D)
    s = np.einsum("thgd,nhd->thgn", qg, k.astype(np.float64))
    j, p = np.arange(n)[None, :], (n - T + np.arange(T))[:, None]
    seen = (j <= p) & ((j > p - window) | (j < sinks) if window else True)
    s = np.where(seen[:, None, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("thgn,nhd->thgd", w / w.sum(-1, keepdims=True),
                     v.astype(np.float64)).reshape(T, HQ, D)


class GroupsMachine(RuleBasedStateMachine):
    """Subclassed once per V format (V)."""

    V = "q4_1"
    snapshots = Bundle("snapshots")

    def __init__(self):
        super().__init__()
        self.spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=N, num_heads=HQ,
                           k_format="q4_1ch", v_format=self.V)
        self.cache = KVCache(self.spec)
        self.model = Model(self.V)
        self.limit = {"k": input_limit(self.spec.k_fmt.id), "v": input_limit(self.spec.v_fmt.id)}
        self.tmp = tempfile.TemporaryDirectory()
        self.files = 0

    def teardown(self):
        self.tmp.cleanup()

    def refused(self, error, call, *args, **kwargs):
        """Runs a call that must raise `error` and leave the cache exactly as it was."""
        c = self.cache
        before = (c._storage.tobytes(), c._groups.residual.tobytes(), list(c._groups.held),
                  c.length, [c.pending(i) for i in range(L)])
        with pytest.raises(error):
            call(*args, **kwargs)
        assert (c._storage.tobytes(), c._groups.residual.tobytes(), list(c._groups.held),
                c.length, [c.pending(i) for i in range(L)]) == before

    @initialize(n=st.one_of(st.sampled_from([G, 2 * G]), st.integers(0, N)),
                seed=st.integers(0, 2**32 - 1))
    def prefill(self, n, seed):
        """Every layer starts with n positions, committed (often ending a group)."""
        for layer in range(L):
            self.append(layer, n, seed + layer, F32, False)
        self.advance()

    @rule(layer=st.integers(0, L - 1), t=st.integers(0, 40), seed=st.integers(0, 2**32 - 1),
          dtype=st.sampled_from([F32, F16]), big=st.booleans())
    def append(self, layer, t, seed, dtype, big):
        rng = np.random.default_rng(seed)
        scale = 10.0 ** rng.uniform(-2, 2)
        k, v = ((rng.standard_normal((2, t, H, D)) * scale).astype(F32))
        k[rng.random((t, H)) < 0.1] = 0                 # some all-zero rows
        if big and t:                                   # a value next to the limit
            k[tuple(rng.integers(s) for s in k.shape)] = np.float32(65000.0) * rng.choice([1, -1])
        k, v = k.astype(dtype), v.astype(dtype)
        if self.model.end(layer) + t > N:
            self.refused(CapacityError, self.cache.append, layer, k, v)
            return
        if any(np.abs(x.astype(F32)).max(initial=0) >= self.limit[w] for w, x in (("k", k), ("v", v))):
            self.refused(FormatError, self.cache.append, layer, k, v)
            return
        self.cache.append(layer, k, v)
        self.model.append(layer, k, v)

    @rule(layer=st.integers(0, L - 1), seed=st.integers(0, 2**32 - 1),
          fault=st.sampled_from(["nan", "inf", "range", "heads", "head_dim", "layer", "full"]))
    def append_bad(self, layer, seed, fault):
        rng = np.random.default_rng(seed)
        t = min(int(rng.integers(1, 4)), N - self.model.end(layer))
        if t == 0 and fault != "full":
            return
        k = rng.standard_normal((t, H, D)).astype(F32)
        v = rng.standard_normal((t, H, D)).astype(F32)
        where = tuple(rng.integers(s) for s in k.shape) if t else None
        error = {"nan": NonFiniteError, "inf": NonFiniteError, "range": FormatError,
                 "heads": ShapeError, "head_dim": ShapeError, "layer": OutOfRangeError,
                 "full": CapacityError}[fault]
        if fault in ("nan", "inf"):
            (k if rng.integers(2) else v)[where] = float(fault)
        elif fault == "range":      # K's float16 limit (65520: q4_1ch's values stay finite)
            k[where] = self.limit["k"] * float(rng.choice([1, -1]))
        elif fault == "heads":
            k = v = np.zeros((t, H + 1, D), F32)
        elif fault == "head_dim":
            k = v = np.zeros((t, H, D + 32), F32)
        elif fault == "layer":
            layer = int(rng.choice([-1, L]))
        else:
            k = v = np.zeros((N - self.model.end(layer) + 1, H, D), F32)
        self.refused(error, self.cache.append, layer, k, v)

    @rule()
    def advance(self):
        m = self.model
        if len(set(m.pending)) > 1:
            self.refused(StateError, self.cache.advance)
            return
        assert self.cache.advance() == m.pending[0]
        m.length, m.pending = m.length + m.pending[0], [0] * L

    @rule(n=st.integers(-1, N + 1), into_group=st.booleans())
    def truncate(self, n, into_group):
        if into_group and self.model.length > G:    # often into an encoded group
            n = self.model.length - 1 - n % G
        if not 0 <= n <= self.model.length:
            self.refused(OutOfRangeError, self.cache.truncate, n)
            return
        self.cache.truncate(n)
        self.model.truncate(n)

    @rule()
    def reset(self):
        self.cache.reset()
        self.model.truncate(0)

    @rule(target=snapshots, n=st.integers(0, N), through_file=st.booleans())
    def snapshot(self, n, through_file):
        n = min(n, self.model.length)
        snap = self.cache.snapshot(n)
        if through_file:
            self.files += 1
            path = os.path.join(self.tmp.name, f"{self.files}.safetensors")
            snap.save(path)
            snap = load_snapshot(path)
        return snap, self.model.state(n)

    @rule(saved=snapshots)
    def restore(self, saved):
        snap, state = saved
        self.cache.restore(snap)
        self.model.restore(state)

    @rule(saved=snapshots, fault=st.sampled_from(["format", "residual"]))
    def restore_bad(self, saved, fault):
        snap, _ = saved
        if fault == "format":   # the other V format: a pair the cache does not hold
            other = "q4_0" if self.V == "q4_1" else "q4_1"
            spec = self.spec.replace(v_format=other)
            bad = kvcore.Snapshot(spec, snap.length, k_codes=snap.k_codes, k_scales=snap.k_scales,
                                  v_codes=np.zeros_like(snap.v_codes),
                                  v_scales=np.zeros(snap.v_scales.shape[:3] + (
                                      spec.v_fmt.scales_per_row(D),), np.float16),
                                  k_residual=snap.k_residual)
            self.refused(kvcore.SnapshotError, self.cache.restore, bad)
        elif snap.length % G:   # a non-finite value in the open group
            res = snap.k_residual.copy()
            res[-1, -1, -1, -1] = np.inf
            bad = kvcore.Snapshot(self.spec, snap.length, k_codes=snap.k_codes,
                                  k_scales=snap.k_scales, v_codes=snap.v_codes,
                                  v_scales=snap.v_scales, k_residual=res)
            self.refused(kvcore.SnapshotError, self.cache.restore, bad)

    @rule(layer=st.integers(0, L - 1), t=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
    def attend(self, layer, t, seed):
        """Decode attention of the last t written positions' queries (causal, over the
        layer's committed and pending positions) equals the float64 reference over the
        model's K and V."""
        m = self.model
        end = m.end(layer)
        if end < t:
            return
        q = np.random.default_rng(seed).standard_normal((t, HQ, D)).astype(F32)
        k, v = m.k(layer, end), m.v(layer, end)
        want = reference(q, k, v)
        got = kvcore.decode_attention(q, self.cache, layer)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * (np.abs(v).max() + 1e-30))

    @invariant()
    def matches_model(self):
        c, m = self.cache, self.model
        assert c.length == m.length
        for layer in range(L):
            assert c.pending(layer) == m.pending[layer]
            end = m.end(layer)
            full = end - end % G
            assert c.keys(layer, pending=True)[:full].tobytes() == m.kc[layer, :full].tobytes()
            assert c.key_scales(layer, pending=True)[:full].tobytes() == m.ks[layer, :full].tobytes()
            assert c.values(layer, pending=True).tobytes() == m.vc[layer, :end].tobytes()
            assert c.value_scales(layer, pending=True).tobytes() == m.vs[layer, :end].tobytes()
            assert c.dequantize(layer, "k", pending=True).tobytes() == m.k(layer, end).tobytes()
            assert c.dequantize(layer, "v", pending=True).tobytes() == m.v(layer, end).tobytes()


PS = 32             # the pools: pages of one group


class PoolGroupsMachine(RuleBasedStateMachine):
    """A KVPool of K q4_1ch / V q4_1 with up to 3 sequences: new, append, append_batch,
    advance, fork, truncate, free, snapshot / restore and decode attention, each
    sequence against its own Model. A call the pool refuses must change nothing (storage,
    page table, every residual); a CapacityError for want of free pages is the pool's to
    decide (the page books are format-independent: test_pool_state_machine checks them),
    one past the capacity CAP is checked. The subclasses below change what a sequence
    holds (a window) or where its pages come from (a prefix cache) through the hooks
    `data`, `positions`, `commit`, `cut` and `restored`."""

    CAP, PAGES = N, 6           # N needs 3 pages per sequence
    WINDOW, SINKS = None, 0
    snapshots = Bundle("snapshots")

    def __init__(self):
        super().__init__()
        self.spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=self.CAP,
                           num_heads=HQ, k_format="q4_1ch", v_format="q4_1")
        self.pool = self.make_pool()
        self.model: dict[int, Model] = {}

    def make_pool(self):
        return KVPool(self.spec, num_pages=self.PAGES, page_size=PS)

    def state(self):
        p, t = self.pool, self.pool._table
        return (p._storage.tobytes(), list(t.free), list(t.refs),
                {s: (list(q.pages), q.length, list(q.pending), q.start) for s, q in t.seqs.items()},
                {s: (g.residual.tobytes(), list(g.held)) for s, g in p._groups.items()})

    def attempt(self, call, *args, **kwargs):
        """Runs call; returns True when it went through, False when the pool refused it
        with CapacityError, having changed nothing."""
        before = self.state()
        try:
            call(*args, **kwargs)
        except CapacityError:
            assert self.state() == before
            return False
        return True

    def refused(self, error, call, *args, **kwargs):
        before = self.state()
        with pytest.raises(error):
            call(*args, **kwargs)
        assert self.state() == before

    def pick(self, i):
        return sorted(self.model)[i % len(self.model)]

    # -- the hooks ---------------------------------------------------------------------

    def data(self, m, layer, t, rng):
        """K and V float32 [t, H, D] of the next t positions of m's layer."""
        return (rng.standard_normal((2, t, H, D)) * 3).astype(F32)

    def positions(self, m, layer):
        """The positions the pool holds of m's layer, in its order: committed, pending."""
        return list(range(m.end(layer)))

    def commit(self, s):
        """advance(s), checked; the model commits."""
        m = self.model[s]
        assert self.pool.advance([s]) == [m.pending[0]]
        m.length, m.pending = m.length + m.pending[0], [0] * L

    def cut(self, s, n):
        """truncate(s, n) of 0 <= n <= length; False when the pool must refuse it."""
        self.pool.truncate(s, n)
        self.model[s].truncate(n)
        return True

    def restored(self, m, snap):
        """The model of a sequence restored from snap (a restore carries no token ids)."""
        m.keyed = False

    def rows(self, m, layer, t):
        """How many of m's last positions of a layer attention may query (0: none)."""
        return min(t, m.end(layer))

    # -- the rules ---------------------------------------------------------------------

    @initialize(n=st.one_of(st.sampled_from([G, 2 * G]), st.integers(0, N)),
                seed=st.integers(0, 2**32 - 1))
    def first(self, n, seed):
        s = self.pool.new_sequence()
        self.model[s] = Model("q4_1", self.CAP)
        for layer in range(L):
            self.append(0, layer, n, seed + layer)
        self.advance(0)

    @precondition(lambda self: len(self.model) < 3)
    @rule()
    def new(self):
        self.model[self.pool.new_sequence()] = Model("q4_1", self.CAP)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 2), layer=st.integers(0, L - 1), t=st.integers(0, 40),
          seed=st.integers(0, 2**32 - 1))
    def append(self, i, layer, t, seed):
        s = self.pick(i)
        m = self.model[s]
        if m.end(layer) + t > self.CAP:
            t = self.CAP - m.end(layer) + 1
            k, v = np.zeros((2, t, H, D), F32)
            self.refused(CapacityError, self.pool.append, k, v, seq=s, layer=layer)
            return
        k, v = self.data(m, layer, t, np.random.default_rng(seed))
        if self.attempt(self.pool.append, k, v, seq=s, layer=layer):
            m.append(layer, k, v)

    @precondition(lambda self: self.model)
    @rule(layer=st.integers(0, L - 1), counts=st.lists(st.integers(0, 20), min_size=3, max_size=3),
          seed=st.integers(0, 2**32 - 1))
    def append_batch(self, layer, counts, seed):
        seqs = sorted(self.model)
        counts = counts[:len(seqs)]
        if any(self.model[s].end(layer) + c > self.CAP for s, c in zip(seqs, counts)):
            k = v = np.zeros((sum(counts), H, D), F32)
            self.refused(CapacityError, self.pool.append_batch, k, v, seqs=seqs, layer=layer,
                         counts=counts)
            return
        rng = np.random.default_rng(seed)
        k, v = np.concatenate([self.data(self.model[s], layer, c, rng)
                               for s, c in zip(seqs, counts)], axis=1)
        if self.attempt(self.pool.append_batch, k, v, seqs=seqs, layer=layer, counts=counts):
            at = 0
            for s, c in zip(seqs, counts):
                self.model[s].append(layer, k[at:at + c], v[at:at + c])
                at += c

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 2))
    def advance(self, i):
        s = self.pick(i)
        if len(set(self.model[s].pending)) > 1:
            self.refused(StateError, self.pool.advance, [s])
            return
        self.commit(s)

    @precondition(lambda self: self.model and len(self.model) < 3)
    @rule(i=st.integers(0, 2))
    def fork(self, i):
        s = self.pick(i)
        before = self.state()
        try:
            t = self.pool.fork(s)
        except CapacityError:
            assert self.state() == before
            return
        f = copy.deepcopy(self.model[s])
        f.truncate(f.length)        # the committed positions, as a snapshot holds them
        self.model[t] = f

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 2), n=st.integers(-1, N + 1), into_group=st.booleans())
    def truncate(self, i, n, into_group):
        s = self.pick(i)
        m = self.model[s]
        if into_group and m.length > G:
            n = m.length - 1 - n % G
        if not 0 <= n <= m.length:
            self.refused(OutOfRangeError, self.pool.truncate, s, n)
        elif not self.cut(s, n):
            self.refused(StateError, self.pool.truncate, s, n)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 2))
    def free(self, i):
        s = self.pick(i)
        self.pool.free(s)
        del self.model[s]

    @precondition(lambda self: self.model)
    @rule(target=snapshots, i=st.integers(0, 2), n=st.integers(0, 2 * N))
    def snapshot(self, i, n):
        s = self.pick(i)
        m = self.model[s]
        n = min(n, m.length)
        return self.pool.snapshot(s, n), m.state(n)

    @rule(saved=snapshots, into=st.integers(-1, 2))
    def restore(self, saved, into):
        """Into a new sequence (into = -1), or over one the model holds."""
        snap, st_ = saved
        seq = self.pick(into) if into >= 0 and self.model else None
        if seq is None and len(self.model) == 3:
            return
        before = self.state()
        try:
            t = self.pool.restore(snap, seq=seq)
        except CapacityError:
            assert self.state() == before
            return
        m = self.model[t] = Model("q4_1", self.CAP)
        m.restore(st_)
        self.restored(m, snap)

    @precondition(lambda self: self.model)
    @rule(layer=st.integers(0, L - 1), t=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
    def attend(self, layer, t, seed):
        """The queries of the last (up to) t positions of each sequence, causal over its
        committed and pending positions under the pool's window: the float64 reference
        over the model's K and V."""
        counts = {s: self.rows(m, layer, t) for s, m in sorted(self.model.items())}
        seqs = [s for s, c in counts.items() if c]
        if not seqs:
            return
        counts = [counts[s] for s in seqs]
        q = np.random.default_rng(seed).standard_normal((sum(counts), HQ, D)).astype(F32)
        out = kvcore.decode_attention(q, self.pool, layer, seqs=seqs, counts=counts)
        at = 0
        for s, c in zip(seqs, counts):
            m = self.model[s]
            end = m.end(layer)
            v = m.v(layer, end)
            want = reference(q[at:at + c], m.k(layer, end), v, self.WINDOW, self.SINKS)
            np.testing.assert_allclose(out[at:at + c], want,
                                       rtol=1e-4, atol=1e-5 * (np.abs(v).max() + 1e-30))
            at += c

    @invariant()
    def matches_model(self):
        p = self.pool
        assert sorted(p._table.seqs) == sorted(self.model)
        for s, m in self.model.items():
            assert p.length(s) == m.length
            for layer in range(L):
                assert p.pending(s, layer) == m.pending[layer]
                end = m.end(layer)
                at = np.array(self.positions(m, layer), np.int64)
                done = at < end - end % G           # in complete groups: their codes
                kc, vc, ks, vs = p._gather(s, layer, pending=True)
                assert kc[done].tobytes() == m.kc[layer, at[done]].tobytes()
                assert ks[done].tobytes() == m.ks[layer, at[done]].tobytes()
                assert vc.tobytes() == m.vc[layer, at].tobytes()
                assert vs.tobytes() == m.vs[layer, at].tobytes()
                for w, want in (("k", m.k(layer, end)), ("v", m.v(layer, end))):
                    assert p.dequantize(s, layer, w, pending=True).tobytes() == want[at].tobytes()


class WindowGroupsMachine(WindowBooks, PoolGroupsMachine):
    """PoolGroupsMachine over a pool with a sliding window (WINDOW, SINKS): pages of whole
    groups leave a sequence as the window slides past them. The model keeps every
    position and each sequence's first held position (`start`, a multiple of PS past the
    sink pages, moved at each commit as docs/design.md says, kept by fork, back to 0 on a
    truncate into the sink pages). Changed rules: truncate and snapshot below what the
    window needs at the new length are refused (StateError, nothing changed); restore
    keeps the window's pages only; attention sees the window and the sink positions.
    Invariant added: every sequence holds exactly the modelled positions, its window's
    needs and its sink positions among them, in at most the pages they need."""

    CAP, PAGES, PAGE = 160, 10, PS

    def make_pool(self):
        return KVPool(self.spec, num_pages=self.PAGES, page_size=PS, window=self.WINDOW,
                      sink_tokens=self.SINKS)

    @initialize(n=st.one_of(st.sampled_from([G, 3 * G, 4 * G]), st.integers(0, CAP)),
                seed=st.integers(0, 2**32 - 1))
    def first(self, n, seed):
        """As PoolGroupsMachine's, often long enough that the window released pages."""
        PoolGroupsMachine.first(self, n, seed)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 2), t=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
    def step(self, i, t, seed):
        """A decode step of one sequence: t positions appended to every layer, each layer
        attended with them pending, then advance."""
        for layer in range(L):
            self.append(i, layer, t, seed + layer)
            self.attend(layer, t, seed + layer)
        self.advance(i)

    def positions(self, m, layer):
        return self.held(m) + list(range(m.length, m.end(layer)))

    def commit(self, s):
        m = self.model[s]
        end = m.length + m.pending[0]
        super().commit(s)
        m.start = self.slid(end, m.start)

    def cut(self, s, n):
        m = self.model[s]
        if not self.may_cut(m, n):
            return False
        super().cut(s, n)
        if n <= self.sink_end:
            m.start = 0
        return True

    def restored(self, m, snap):
        super().restored(m, snap)
        m.start = self.slid(m.length, snap.start)

    def rows(self, m, layer, t):
        """A step's pending positions (attended before their advance: the window's first
        position is held)."""
        return min(t, m.pending[layer])

    @precondition(lambda self: self.model)
    @rule(target=PoolGroupsMachine.snapshots, i=st.integers(0, 2), n=st.integers(0, 2 * N))
    def snapshot(self, i, n):
        s = self.pick(i)
        m = self.model[s]
        n = min(n, m.length)
        if not self.may_cut(m, n):
            self.refused(StateError, self.pool.snapshot, s, n)
            return multiple()
        snap = self.pool.snapshot(s, n)
        assert snap.start == (0 if n <= self.sink_end else m.start)
        assert snap.held == len(self.held(m, n))
        return snap, m.state(n)

    @invariant()
    def holds_what_the_window_needs(self):
        self.check_holdings()


class PrefixGroupsMachine(PoolGroupsMachine):
    """PoolGroupsMachine over a pool with a prefix cache: every position's K/V is a
    function of its sequence's extras and token ids up to it (`kv`), so the model knows
    what a matched page holds (a page is one group: its K codes encoded over the group).
    Tokens are mostly 0, so that sequences written apart share whole pages of ids.
    Sequences commit with their ids; new rule: match (the longest cached prefix of a live
    sequence's ids or of a random prompt, under one of two extras); free puts registered
    pages into the cache, and the pool's few pages make writes evict. Invariants added:
    free + cached + in use = PAGES, and every registered page holds exactly the K codes
    and scales and the V rows of the prefix its key names (the cache never lies)."""

    CAP, PAGES = 4 * G, 4        # a sequence may want every page: writes evict
    EXTRAS = [None, {"salt": "x"}]

    def __init__(self):
        super().__init__()
        self.prefixes = {}          # key -> the token ids it names (every registered page)
        self._kv = {}

    def make_pool(self):
        return KVPool(self.spec, num_pages=self.PAGES, page_size=PS, prefix_cache=True)

    def state(self):
        idx = self.pool._table.prefix
        return super().state() + (dict(idx.by_key), list(idx.lru), idx.hits, idx.misses,
                                  idx.evictions)

    def kv(self, extra, ids, layer):
        """K and V [2, H, D] of the last of `ids` under `extra`: float16-exact float32."""
        memo = (repr(extra), tuple(ids), layer)
        if memo not in self._kv:
            seed = hashlib.sha256(repr(memo).encode()).digest()
            x = np.random.default_rng(int.from_bytes(seed[:8], "little")).standard_normal((2, H, D))
            self._kv[memo] = (x * 3).astype(F16).astype(F32)
        return self._kv[memo]

    def data(self, m, layer, t, rng):
        end = m.end(layer)
        while len(m.ids) < end + t:             # pending tokens, shared by every layer
            m.ids.append(int(rng.random() < 0.02))
        kv = [self.kv(m.extra, m.ids[:p + 1], layer) for p in range(end, end + t)]
        return np.stack(kv, axis=1) if kv else np.zeros((2, 0, H, D), F32)

    def commit(self, s):
        m = self.model[s]
        end = m.length + m.pending[0]
        ids = m.ids[:end]
        assert self.pool.advance(s, tokens=ids[m.length:]) == m.pending[0]
        m.length, m.pending = end, [0] * L
        if m.keyed:
            for i, key in enumerate(prefix_keys(ids, PS, m.extra)):
                self.prefixes[key] = ids[:(i + 1) * PS]

    @precondition(lambda self: len(self.model) < 3)
    @rule(data=st.data(), extra=st.integers(0, 1), tail=st.integers(0, 40),
          seed=st.integers(0, 2**32 - 1))
    def match(self, data, extra, tail, seed):
        """match_prefix of a live sequence's ids (or a random prompt) plus `tail` more."""
        rng = np.random.default_rng(seed)
        live = [m for m in self.model.values() if m.length]
        base = data.draw(st.sampled_from(live)).ids[:self.CAP] if live and rng.integers(4) else []
        tokens = (list(base) + (rng.random(tail) < 0.02).astype(int).tolist())[:self.CAP]
        self.match_tokens(tokens, self.EXTRAS[extra], rng)

    def match_tokens(self, tokens, extra, rng):
        """match_prefix(tokens, extra), its counts checked, and the new sequence modelled
        from its tokens alone (what its pages must hold)."""
        before = self.pool.stats
        s, n = self.pool.match_prefix(tokens, extra=extra)
        assert n % PS == 0 and n <= max(0, len(tokens) - 1)
        self.check_counts(before, self.pool.stats, tokens, n)
        m = self.model[s] = Model("q4_1", self.CAP)
        m.ids, m.extra = list(tokens[:n]), extra
        for layer in range(L):
            m.append(layer, *self.data(m, layer, n, rng))
        m.length, m.pending = n, [0] * L

    def check_counts(self, before, after, tokens, n):
        assert after.hits - before.hits == n // PS
        assert after.misses - before.misses == max(0, (len(tokens) - 1) // PS) - n // PS
        assert after.evictions == before.evictions

    @invariant()
    def pages_add_up(self):
        t, idx, st_ = self.pool._table, self.pool._table.prefix, self.pool.stats
        holders = [0] * self.PAGES
        for seq in t.seqs.values():
            for g in seq.pages:
                holders[g] += 1
        assert t.refs == holders
        assert st_.free + st_.cached + st_.in_use == self.PAGES
        assert sorted(t.free + list(idx.lru)) == [g for g in range(self.PAGES) if not holders[g]]

    @invariant()
    def cache_never_lies(self):
        """Every registered page holds the codes of the prefix its key names: K's group
        (kvcore.quantize of its float16 K by channel) and V's rows."""
        idx = self.pool._table.prefix
        for g, e in idx.entries.items():
            ids = self.prefixes[e.key]
            assert np.array(ids[-PS:], "<i8").tobytes() == e.ids
            extra = next(x for x in self.EXTRAS if encode_extra(x) == e.extra)
            for layer in range(L):
                kc, vc, ks, vs = self.pool._store.gather(layer, np.arange(g * PS, (g + 1) * PS))
                k, v = np.stack([self.kv(extra, ids[:p + 1], layer)
                                 for p in range(len(ids) - PS, len(ids))], axis=1)
                c, sc = kvcore.quantize(k.swapaxes(0, 1), "q4_1ch")
                assert kc.tobytes() == c.swapaxes(0, 1).tobytes()
                assert ks.tobytes() == sc.swapaxes(0, 1).tobytes()
                c, sc = kvcore.quantize(v, "q4_1")
                assert vc.tobytes() == c.tobytes() and vs.tobytes() == sc.tobytes()


class StorePrefixGroupsMachine(PrefixGroupsMachine):
    """PrefixGroupsMachine with a chunk store in a directory (chunks of 2 pages: whole
    groups) and a StoreWriter saving the chunks each commit completes (flushed after it):
    a match may go on in the store past what the pool evicted, and a restart (another
    pool over the same store, nothing in memory) finds saved sequences there. Added: the
    pages found in memory plus those loaded equal the positions matched, and the matched
    sequence then holds exactly the codes of its tokens' K/V (matches_model, from the
    tokens alone) whichever tier they came from; no store fault."""

    store = None

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvcore-groups-store-")
        super().__init__()
        self.saved = []             # (ids, extra) of sequences whose chunks were saved

    def make_pool(self):
        """A pool over the machine's store (made with the first pool)."""
        from kvcore.store import DirectoryBackend, KVStore, StoreWriter
        if self.store is None:
            self.store = KVStore(DirectoryBackend(self.dir, fsync=False), model="groups",
                                 spec=self.spec, chunk_tokens=2 * PS, page_size=PS)
            self.writer = StoreWriter(self.store)
        return KVPool(self.spec, num_pages=self.PAGES, page_size=PS, prefix_cache=True,
                      store=self.store, store_writer=self.writer)

    def teardown(self):
        self.writer.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def commit(self, s):
        super().commit(s)
        self.writer.flush()
        assert self.writer.stats.failed == 0, self.writer.stats.last_error
        m = self.model[s]
        if m.keyed and m.length >= 2 * PS and (m.ids[:m.length], m.extra) not in self.saved:
            self.saved.append((m.ids[:m.length], m.extra))

    @rule(data=st.data(), tail=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def restart(self, data, tail, seed):
        """Another pool over the same store: every sequence gone, nothing cached."""
        self.pool = self.make_pool()
        self.model = {}
        if self.saved:
            self.match_saved(data, tail, seed)

    @precondition(lambda self: self.saved and len(self.model) < 3)
    @rule(data=st.data(), tail=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def match_saved(self, data, tail, seed):
        """match_prefix of a saved sequence's ids plus `tail` more."""
        ids, extra = data.draw(st.sampled_from(self.saved))
        rng = np.random.default_rng(seed)
        tokens = (ids + (rng.random(tail) < 0.02).astype(int).tolist())[:self.CAP]
        self.match_tokens(tokens, extra, rng)

    def check_counts(self, before, after, tokens, n):
        loaded = after.store_hits - before.store_hits
        assert after.hits - before.hits + loaded == n // PS
        assert after.misses - before.misses == max(0, (len(tokens) - 1) // PS) - n // PS
        assert after.store_faults == 0, after.last_store_fault


TestGroups_q4_1 = machine_test(GroupsMachine, "GroupsMachine_q4_1", {"V": "q4_1"}, EXAMPLES, STEPS)
TestGroups_q4_0 = machine_test(GroupsMachine, "GroupsMachine_q4_0", {"V": "q4_0"}, EXAMPLES, STEPS)
TestPoolGroups = machine_test(PoolGroupsMachine, "PoolGroupsMachine_q4_1", {}, EXAMPLES, STEPS)
# a window alone (its pages slide past group by group), and one with a sink page
TestWindowGroups = machine_test(WindowGroupsMachine, "WindowGroupsMachine_20",
                                {"WINDOW": 20, "SINKS": 0}, EXAMPLES, STEPS)
TestWindowSinkGroups = machine_test(WindowGroupsMachine, "WindowGroupsMachine_40_3",
                                    {"WINDOW": 40, "SINKS": 3}, EXAMPLES, STEPS)
TestPrefixGroups = machine_test(PrefixGroupsMachine, "PrefixGroupsMachine", {}, EXAMPLES, STEPS)
TestStorePrefixGroups = machine_test(StorePrefixGroupsMachine, "StorePrefixGroupsMachine", {},
                                     EXAMPLES // 2, STEPS)
