"""Nothing is lost with K in q4_1ch: hypothesis state machines drive a KVCache and a KVPool
whose K is
stored by channel over groups of 32 positions (V per token, in q4_1 or q4_0) with random
appends of up to 40 positions, advance, truncate (into encoded groups too), reset,
snapshot and restore (through a file too) and refused calls, against a numpy model:
per layer the float16 K each position holds (K is rounded to float16 on append; a
truncation into an encoded group leaves its kept positions holding their decoded values,
rounded to float16), each complete group's codes and scales (kvcore.quantize of its
float16 K, one head at a time), and V's codes and scales per position.

After every step: the lengths; the codes and scales of every complete group, byte for
byte; K and V as `dequantize` decodes them, committed and pending, bit for bit. After
every refused call: the storage, the residual and the lengths are as they were. A rule
compares decode attention (the grouped kernel) with a float64 reference over the model's
values.

Examples per V format: KVCORE_STATE_EXAMPLES (default 40, the CI budget), steps per
example: KVCORE_STATE_STEPS (default 30).
"""
import copy
import os
import tempfile

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule)

import kvcore
from kvcore import KVCache, KVPool, KVSpec, load_snapshot
from kvcore.errors import (CapacityError, FormatError, NonFiniteError, OutOfRangeError,
                           ShapeError, StateError)
from kvcore._quant import input_limit

from _machines import machine_test, one_thread  # noqa: F401  (one_thread: autouse fixture)

EXAMPLES = int(os.environ.get("KVCORE_STATE_EXAMPLES", "40"))
STEPS = int(os.environ.get("KVCORE_STATE_STEPS", "30"))
L, H, D, N, G = 2, 2, 32, 80, 32      # capacity N: two complete groups and an open one
HQ = 2 * H
F16, F32 = np.float16, np.float32


def decode_group(codes, scales):
    """float32 [G, H, D]: a complete group's K from its codes [G, H, D/2] and scales."""
    return kvcore.dequantize(codes.swapaxes(0, 1), scales.swapaxes(0, 1), "q4_1ch").swapaxes(0, 1)


class Model:
    """The cache as plain numpy (module comment)."""

    def __init__(self, vfmt):
        self.vfmt = kvcore.formats.FORMATS[vfmt]
        self.k16 = np.zeros((L, N, H, D), F16)
        self.kc = np.zeros((L, N, H, D // 2), np.uint8)
        self.ks = np.zeros((L, N, H, D // 16), F16)
        self.vc = np.zeros((L, N, H, self.vfmt.code_width(D)), self.vfmt.code_dtype)
        self.vs = np.zeros((L, N, H, self.vfmt.scales_per_row(D)), self.vfmt.scale_dtype)
        self.length, self.pending = 0, [0] * L

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

    def state(self, n):
        """What a snapshot of [0, n) holds (copies)."""
        return {"kc": self.kc[:, :n].copy(), "ks": self.ks[:, :n].copy(),
                "vc": self.vc[:, :n].copy(), "vs": self.vs[:, :n].copy(),
                "open": [self.open_values(layer, n) for layer in range(L)], "n": n}

    def restore(self, st_):
        n = st_["n"]
        for name in ("kc", "ks", "vc", "vs"):
            getattr(self, name)[:, :n] = st_[name]
        for layer in range(L):
            self.k16[layer, n - n % G:n] = st_["open"][layer]
        self.length, self.pending = n, [0] * L


def reference(q, k, v):
    """float64 causal attention of q [T, HQ, D] over k, v [n, H, D]."""
    T, n = len(q), len(k)
    qg = q.astype(np.float64).reshape(T, H, HQ // H, D) / np.sqrt(D)
    s = np.einsum("thgd,nhd->thgn", qg, k.astype(np.float64))
    s = np.where((np.arange(n)[None, :] <= (n - T + np.arange(T))[:, None])[:, None, None],
                 s, -np.inf)
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


PS, P = 32, 6       # the pool: pages of one group, 6 of them (N = 80 needs 3 per sequence)


class PoolGroupsMachine(RuleBasedStateMachine):
    """A KVPool of K q4_1ch / V q4_1 with up to 3 sequences: new, append, append_batch,
    advance, fork, truncate, free, snapshot / restore and decode attention, each
    sequence against its own Model. A call the pool refuses must change nothing (storage,
    page table, every residual); a CapacityError for want of free pages is the pool's to
    decide (the page books are format-independent: test_pool_state_machine checks them),
    one past the capacity N is checked."""

    snapshots = Bundle("snapshots")

    def __init__(self):
        super().__init__()
        self.spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=N, num_heads=HQ,
                           k_format="q4_1ch", v_format="q4_1")
        self.pool = KVPool(self.spec, num_pages=P, page_size=PS)
        self.model: dict[int, Model] = {}

    def state(self):
        p, t = self.pool, self.pool._table
        return (p._storage.tobytes(), list(t.free), list(t.refs),
                {s: (list(q.pages), q.length, list(q.pending)) for s, q in t.seqs.items()},
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

    @initialize(n=st.one_of(st.sampled_from([G, 2 * G]), st.integers(0, N)),
                seed=st.integers(0, 2**32 - 1))
    def first(self, n, seed):
        s = self.pool.new_sequence()
        self.model[s] = Model("q4_1")
        for layer in range(L):
            self.append(0, layer, n, seed + layer)
        self.advance(0)

    @precondition(lambda self: len(self.model) < 3)
    @rule()
    def new(self):
        self.model[self.pool.new_sequence()] = Model("q4_1")

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 2), layer=st.integers(0, L - 1), t=st.integers(0, 40),
          seed=st.integers(0, 2**32 - 1))
    def append(self, i, layer, t, seed):
        s = self.pick(i)
        m = self.model[s]
        k, v = (np.random.default_rng(seed).standard_normal((2, t, H, D)) * 3).astype(F32)
        if m.end(layer) + t > N:
            self.refused(CapacityError, self.pool.append, k, v, seq=s, layer=layer)
        elif self.attempt(self.pool.append, k, v, seq=s, layer=layer):
            m.append(layer, k, v)

    @precondition(lambda self: self.model)
    @rule(layer=st.integers(0, L - 1), counts=st.lists(st.integers(0, 20), min_size=3, max_size=3),
          seed=st.integers(0, 2**32 - 1))
    def append_batch(self, layer, counts, seed):
        seqs = sorted(self.model)
        counts = counts[:len(seqs)]
        k, v = (np.random.default_rng(seed).standard_normal((2, sum(counts), H, D))).astype(F32)
        if any(self.model[s].end(layer) + c > N for s, c in zip(seqs, counts)):
            self.refused(CapacityError, self.pool.append_batch, k, v, seqs=seqs, layer=layer,
                         counts=counts)
        elif self.attempt(self.pool.append_batch, k, v, seqs=seqs, layer=layer, counts=counts):
            at = 0
            for s, c in zip(seqs, counts):
                self.model[s].append(layer, k[at:at + c], v[at:at + c])
                at += c

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 2))
    def advance(self, i):
        s = self.pick(i)
        m = self.model[s]
        if len(set(m.pending)) > 1:
            self.refused(StateError, self.pool.advance, [s])
            return
        assert self.pool.advance([s]) == [m.pending[0]]
        m.length, m.pending = m.length + m.pending[0], [0] * L

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
            return
        self.pool.truncate(s, n)
        m.truncate(n)

    @precondition(lambda self: self.model)
    @rule(i=st.integers(0, 2))
    def free(self, i):
        s = self.pick(i)
        self.pool.free(s)
        del self.model[s]

    @precondition(lambda self: self.model)
    @rule(target=snapshots, i=st.integers(0, 2), n=st.integers(0, N))
    def snapshot(self, i, n):
        m = self.model[self.pick(i)]
        n = min(n, m.length)
        return self.pool.snapshot(self.pick(i), n), m.state(n)

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
        m = self.model[t] = Model("q4_1")
        m.restore(st_)

    @precondition(lambda self: self.model)
    @rule(layer=st.integers(0, L - 1), seed=st.integers(0, 2**32 - 1))
    def attend(self, layer, seed):
        """One query per sequence over its committed and pending positions: the float64
        reference over the model's K and V."""
        seqs = [s for s in sorted(self.model) if self.model[s].end(layer)]
        if not seqs:
            return
        q = np.random.default_rng(seed).standard_normal((len(seqs), HQ, D)).astype(F32)
        out = kvcore.decode_attention(q, self.pool, layer, seqs=seqs)
        for b, s in enumerate(seqs):
            m = self.model[s]
            end = m.end(layer)
            v = m.v(layer, end)
            np.testing.assert_allclose(out[b:b + 1], reference(q[b:b + 1], m.k(layer, end), v),
                                       rtol=1e-4, atol=1e-5 * (np.abs(v).max() + 1e-30))

    @invariant()
    def matches_model(self):
        p = self.pool
        assert sorted(p._table.seqs) == sorted(self.model)
        for s, m in self.model.items():
            assert p.length(s) == m.length
            for layer in range(L):
                assert p.pending(s, layer) == m.pending[layer]
                end = m.end(layer)
                full = end - end % G
                kc, vc, ks, vs = p._gather(s, layer, pending=True)
                assert kc[:full].tobytes() == m.kc[layer, :full].tobytes()
                assert ks[:full].tobytes() == m.ks[layer, :full].tobytes()
                assert vc.tobytes() == m.vc[layer, :end].tobytes()
                assert vs.tobytes() == m.vs[layer, :end].tobytes()
                assert p.dequantize(s, layer, "k", pending=True).tobytes() == m.k(layer, end).tobytes()
                assert p.dequantize(s, layer, "v", pending=True).tobytes() == m.v(layer, end).tobytes()


TestGroups_q4_1 = machine_test(GroupsMachine, "GroupsMachine_q4_1", {"V": "q4_1"}, EXAMPLES, STEPS)
TestGroups_q4_0 = machine_test(GroupsMachine, "GroupsMachine_q4_0", {"V": "q4_0"}, EXAMPLES, STEPS)
TestPoolGroups = machine_test(PoolGroupsMachine, "PoolGroupsMachine_q4_1", {}, EXAMPLES, STEPS)
