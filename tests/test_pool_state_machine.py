"""Nothing leaks or tears: a hypothesis state machine drives a small KVPool of each format
and K/V pair (tests/_formats.py; each side modelled in its own format; few pages, so that
writes run out of them) with random new / append / append_batch /
advance / fork / truncate / free / snapshot-restore calls and refused ones, against a
plain model: per sequence its expected codes and scales (kvcore.quantize of each step,
the documented contract of a write), length and pending counts, and its pages as
abstract tokens shared by fork (to predict when a write needs a page or a copy).

After every step: free + held pages = P, every reference count equals the number of
sequences whose table names the page, no free page is reachable from a table, the block
tables the table keeps for attention are its sequences' own, and every
sequence reads back exactly what was written to it (codes and scales, byte for byte,
committed and pending); batched decode attention over the sequences equals, bit for
bit, attention on a KVCache restored from the model's codes. After every refused call: the storage, the free list, the
reference counts and every sequence's table, length and pending counts are unchanged.

PrefixMachine runs the same rules over a pool with a prefix cache (one format per storage
layout: f16, int8, q4_1), K/V a function of the token ids, plus match_prefix and free into the cache (its docstring lists its invariants);
StorePrefixMachine adds a chunk store (a directory) and its writer to that cache.
WindowMachine and WindowPrefixMachine run them over a pool with a sliding window
(WindowRules lists what changes and the invariants it adds).

Examples per format: KVCORE_POOL_EXAMPLES (default 40, the CI budget), steps per
example: KVCORE_POOL_STEPS (default 30); e.g. KVCORE_POOL_EXAMPLES=500 for a long run.
"""
import hashlib
import itertools
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import kvcore
from kvcore import KVCache, KVPool, KVSpec, Snapshot
from kvcore.formats import ROW_FORMATS as FORMATS   # K and V in one format (q4_1ch is K only)
from kvcore._prefix_keys import encode_extra, prefix_keys
from kvcore.errors import (CapacityError, DTypeError, NonFiniteError, OutOfRangeError,
                           ShapeError, StateError)

from _formats import PAIRS
from _machines import WindowBooks, machine_test, one_thread  # noqa: F401  (one_thread: autouse)

EXAMPLES = int(os.environ.get("KVCORE_POOL_EXAMPLES", "40"))
STEPS = int(os.environ.get("KVCORE_POOL_STEPS", "30"))
L, H, D, N = 2, 2, 32, 10          # capacity N positions per sequence
P, PS = 8, 3                       # 8 pages of 3 positions: 24 positions for all sequences
_tokens = itertools.count()


class Seq:
    """The model of one sequence."""

    def __init__(self, fmts):
        """fmts: (K's Format, V's Format); scales[w] is None for a side without scales."""
        self.fmts = fmts
        self.codes = {w: np.zeros((L, N, H, f.code_width(D)), f.code_dtype)
                      for w, f in zip("kv", fmts)}
        self.scales = {w: np.zeros((L, N, H, f.scales_per_row(D)), f.scale_dtype)
                       if f.scales_per_row(D) else None for w, f in zip("kv", fmts)}
        self.length = 0
        self.pending = [0] * L
        self.pages = []            # abstract page tokens, shared between forks
        self.ids = []              # token ids (PrefixMachine): committed, then pending
        self.extra = None
        self.keyed = True
        self.start = 0             # first held position past the sink pages (a window's)

    def copy(self):
        c = Seq(self.fmts)
        c.take(self, N)
        c.length = self.length
        c.ids, c.extra, c.keyed = self.ids[:self.length], self.extra, self.keyed
        return c

    def take(self, other, n):
        """Positions [0, n) of other's codes and scales."""
        for w in "kv":
            self.codes[w][:, :n] = other.codes[w][:, :n]
            if self.scales[w] is not None:
                self.scales[w][:, :n] = other.scales[w][:, :n]

    def parts(self, n):
        """Snapshot parts of positions [0, n)."""
        out = {f"{w}_codes": self.codes[w][:, :n].copy() for w in "kv"}
        out.update({f"{w}_scales": self.scales[w][:, :n].copy() for w in "kv"
                    if self.scales[w] is not None})
        return out


class PoolMachine(RuleBasedStateMachine):
    """Subclassed once per format (FORMAT)."""

    FORMAT = "f32"

    def __init__(self):
        super().__init__()
        self.spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=N,
                           format=self.FORMAT)
        self.fmts = self.spec.fmts
        self.pool = KVPool(self.spec, num_pages=P, page_size=PS)
        self.model: dict[int, Seq] = {}

    # ------------------------------------------------------------------ model

    def holders(self):
        count = {}
        for m in self.model.values():
            for g in m.pages:
                count[g] = count.get(g, 0) + 1
        return count

    def free_pages(self):
        """Pages a write may take (free ones; cached ones too, with a prefix cache)."""
        return P - len(self.holders())

    def page_list(self, s):
        return self.model[s].pages

    def plan(self, s, layer, t, holders=None):
        """New pages a write of t positions to s needs: pages past its held ones, plus a
        copy of each shared page the write lands in. `holders` (default: now's) loses the
        holds the copies give up, so that a batch's later writes see its earlier ones."""
        m = self.model[s]
        pages = self.page_list(s)
        end = m.length + m.pending[layer]
        if t == 0:
            return 0, end
        first, last = end // PS, (end + t - 1) // PS
        holders = self.holders() if holders is None else holders
        shared = [pages[i] for i in range(first, min(last + 1, len(pages)))
                  if holders[pages[i]] > 1]
        for g in shared:
            holders[g] -= 1
        return len(shared) + max(0, last + 1 - len(pages)), end

    def plans(self, layer, seqs, counts):
        """plan of each write of one batch, in order."""
        holders = self.holders()
        return [self.plan(s, layer, t, holders) for s, t in zip(seqs, counts)]

    def pool_advance(self, seqs=None):
        """pool.advance (PrefixMachine passes the token ids too)."""
        return self.pool.advance(seqs)

    def apply(self, s, layer, t, codes, scales, end):
        """Records a write the pool accepted; codes/scales: (K's, V's) [t, H, D / S] (a
        side's scales None without)."""
        m = self.model[s]
        if t == 0:
            return
        self.track_pages(m, end // PS, (end + t - 1) // PS)
        for i, w in enumerate("kv"):
            m.codes[w][layer, end:end + t] = codes[i]
            if m.scales[w] is not None:
                m.scales[w][layer, end:end + t] = scales[i]
        m.pending[layer] += t

    def track_pages(self, m, first, last):
        """A write to pages [first, last] of m: shared ones are copied, new ones taken."""
        holders = self.holders()
        for i in range(first, min(last + 1, len(m.pages))):
            if holders[m.pages[i]] > 1:
                m.pages[i] = next(_tokens)
        while len(m.pages) <= last:
            m.pages.append(next(_tokens))

    def encode(self, k, v):
        """(K's codes, V's codes), (K's scales, V's scales): kvcore.quantize's in each
        side's format (a side's scales None without)."""
        enc = [kvcore.quantize(np.asarray(x, np.float32), f) for x, f in zip((k, v), self.fmts)]
        return (tuple(c.view(f.code_dtype) for (c, _), f in zip(enc, self.fmts)),
                tuple(sc for _, sc in enc))

    def state(self):
        t = self.pool._table
        return (self.pool._storage.tobytes(), list(t.free), list(t.refs), t._next_id,
                {s: (list(q.pages), q.length, list(q.pending)) for s, q in t.seqs.items()})

    def refused(self, error, call, *args, **kwargs):
        before = self.state()
        with pytest.raises(error):
            call(*args, **kwargs)
        assert self.state() == before

    def write_data(self, rng, s, layer, end, t):
        """K, V of positions [end, end + t) of s in `layer` (random here)."""
        return self.data(rng, t)

    def data(self, rng, t):
        scale = 10.0 ** rng.uniform(-2, 2)
        return ((rng.standard_normal((t, H, D)) * scale).astype(np.float32),
                (rng.standard_normal((t, H, D)) * scale).astype(np.float32))

    # ------------------------------------------------------------------ rules

    @initialize(a=st.integers(0, 9), b=st.integers(0, 9), seed=st.integers(0, 2**32 - 1))
    def two_sequences(self, a, b, seed):
        """Two sequences prefilled with a and b positions (within the pool's 24)."""
        for _ in range(2):
            self.new()
        for layer in range(L):
            assert self.batch(layer, [0, 1], [a, b], seed + layer)
        assert self.pool_advance([0, 1]) == [a, b]
        for s, n in ((0, a), (1, b)):
            self.model[s].length = n
            self.model[s].pending = [0] * L

    @precondition(lambda self: len(self.model) < 4)
    @rule()
    def new(self):
        s = self.pool.new_sequence()
        assert s not in self.model
        self.model[s] = Seq(self.fmts)

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 3), layer=st.integers(0, L - 1), t=st.integers(0, 5),
          seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from([np.float32, np.float16]))
    def append(self, pick, layer, t, seed, dtype):
        s = sorted(self.model)[pick % len(self.model)]
        need, end = self.plan(s, layer, t)
        k, v = self.write_data(np.random.default_rng(seed), s, layer, end, t)
        k, v = k.astype(dtype).astype(np.float32), v.astype(dtype).astype(np.float32)
        if end + t > N or need > self.free_pages():
            self.refused(CapacityError, self.pool.append, k.astype(dtype), v, seq=s, layer=layer)
            return
        self.pool.append(k.astype(dtype), v, seq=s, layer=layer)
        codes, scales = self.encode(k, v)
        self.apply(s, layer, t, codes, scales, end)

    def batch(self, layer, seqs, counts, seed) -> bool:
        """append_batch of one layer; returns whether the pool took it."""
        rng = np.random.default_rng(seed)
        plans = self.plans(layer, seqs, counts)
        parts = [self.write_data(rng, s, layer, end, t)
                 for s, t, (_, end) in zip(seqs, counts, plans)]
        k = np.concatenate([kv[0] for kv in parts]) if parts else np.zeros((0, H, D), np.float32)
        v = np.concatenate([kv[1] for kv in parts]) if parts else k
        if any(end + t > N for (_, end), t in zip(plans, counts)) or \
                sum(need for need, _ in plans) > self.free_pages():
            self.refused(CapacityError, self.pool.append_batch, k, v, seqs=seqs, layer=layer,
                         counts=counts)
            return False
        self.pool.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
        codes, scales = self.encode(k, v)
        at = 0
        for s, t, (_, end) in zip(seqs, counts, plans):
            self.apply(s, layer, t, [c[at:at + t] for c in codes],
                       [None if x is None else x[at:at + t] for x in scales], end)
            at += t
        return True

    def draw_batch(self, data):
        live = sorted(self.model)
        seqs = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live),
                                  unique=True))
        counts = data.draw(st.lists(st.integers(0, 4), min_size=len(seqs), max_size=len(seqs)))
        return seqs, counts

    @precondition(lambda self: self.model)
    @rule(layer=st.integers(0, L - 1), data=st.data(), seed=st.integers(0, 2**32 - 1))
    def append_batch(self, layer, data, seed):
        self.batch(layer, *self.draw_batch(data), seed)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def step(self, data, seed):
        """A decode step: the same positions appended to every layer, then advance."""
        seqs, counts = self.draw_batch(data)
        if not all(self.batch(layer, seqs, counts, seed + layer) for layer in range(L)):
            return
        if any(len(set(self.model[s].pending)) > 1 for s in seqs):
            self.refused(StateError, self.pool.advance, seqs)
            return
        assert self.pool_advance(seqs) == [self.model[s].pending[0] for s in seqs]
        for s in seqs:
            self.model[s].length += self.model[s].pending[0]
            self.model[s].pending = [0] * L

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 3), seed=st.integers(0, 2**32 - 1),
          fault=st.sampled_from(["nan", "inf", "shape", "dtype", "unknown", "twice", "counts"]))
    def append_bad(self, pick, seed, fault):
        live = sorted(self.model)
        s = live[pick % len(live)]
        need, end = self.plan(s, 0, 2)
        if end + 2 > N or need > self.free_pages():
            return                 # only the fault itself may be wrong
        rng = np.random.default_rng(seed)
        k, v = self.data(rng, 2)
        seqs, counts = [s], [2]
        error = {"nan": NonFiniteError, "inf": NonFiniteError, "shape": ShapeError,
                 "dtype": DTypeError, "unknown": StateError, "twice": StateError,
                 "counts": ShapeError}[fault]
        if fault in ("nan", "inf"):
            (k if rng.integers(2) else v)[1, 1, int(rng.integers(D))] = float(fault)
        elif fault == "shape":
            v = v[:, :, :-1]
        elif fault == "dtype":
            k = k.astype(np.float64)
        elif fault == "unknown":
            seqs = [max(self.model) + 1 + int(rng.integers(3))]
        elif fault == "twice":
            seqs, counts = [s, s], [1, 1]
        else:
            counts = [3]
        self.refused(error, self.pool.append_batch, k, v, seqs=seqs, layer=0, counts=counts)

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 4))
    def advance(self, pick):
        live = sorted(self.model)
        if pick >= len(live):      # every sequence at once
            if any(len(set(m.pending)) > 1 for m in self.model.values()):
                self.refused(StateError, self.pool.advance)
                return
            assert self.pool_advance() == [self.model[s].pending[0] for s in live]
            targets = live
        else:
            m = self.model[live[pick]]
            if len(set(m.pending)) > 1:
                self.refused(StateError, self.pool.advance, live[pick])
                return
            assert self.pool_advance(live[pick]) == m.pending[0]
            targets = [live[pick]]
        for s in targets:
            m = self.model[s]
            m.length += m.pending[0]
            m.pending = [0] * L

    @precondition(lambda self: self.model and len(self.model) < 4)
    @rule(pick=st.integers(0, 3))
    def fork(self, pick):
        s = sorted(self.model)[pick % len(self.model)]
        m = self.model[s]
        full, part = divmod(m.length, PS)
        if part and self.free_pages() == 0:
            self.refused(CapacityError, self.pool.fork, s)
            return
        t = self.pool.fork(s)
        c = m.copy()
        c.pages = m.pages[:full] + ([next(_tokens)] if part else [])
        self.model[t] = c

    @precondition(lambda self: self.model and len(self.model) < 4)
    @rule(pick=st.integers(0, 3), back=st.integers(1, 4), which=st.booleans(),
          seed=st.integers(0, 2**32 - 1))
    def fork_and_rewrite(self, pick, back, which, seed):
        """Speculative decoding's rollback: fork, drop the last `back` positions of one of
        the two (often into a page they share), decode one step into it."""
        s = sorted(self.model)[pick % len(self.model)]
        self.fork(pick)
        if len(self.model) == 1 or max(self.model) == s:
            return                 # the fork was refused
        target = max(self.model) if which else s
        self.truncate_to(target, max(0, self.model[target].length - back))
        if any(self.model[target].pending):   # refused (a window): drop the pending ones
            self.truncate_to(target, self.model[target].length)
        for layer in range(L):
            if not self.batch(layer, [target], [1], seed + layer):
                return
        assert self.pool_advance(target) == 1
        self.model[target].length += 1
        self.model[target].pending = [0] * L

    def truncate_to(self, s, n):
        m = self.model[s]
        if not 0 <= n <= m.length:
            self.refused(OutOfRangeError, self.pool.truncate, s, n)
            return
        self.pool.truncate(s, n)
        m.length = n
        m.pending = [0] * L
        del m.pages[-(-n // PS):]
        del m.ids[n:]

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 3), cut=st.integers(0, 4), bad=st.sampled_from([0, 0, 0, -1, 1]))
    def truncate(self, pick, cut, bad):
        """To a point within the length (often inside a page a fork shares), or just
        outside it (bad)."""
        s = sorted(self.model)[pick % len(self.model)]
        m = self.model[s]
        self.truncate_to(s, -1 if bad < 0 else m.length + 1 if bad else m.length * cut // 4)

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 3))
    def free(self, pick):
        s = sorted(self.model)[pick % len(self.model)]
        self.pool.free(s)
        del self.model[s]
        self.refused(StateError, self.pool.free, s)

    @precondition(lambda self: self.model and len(self.model) < 4)
    @rule(pick=st.integers(0, 3), n=st.integers(0, N))
    def snapshot_restore(self, pick, n):
        s = sorted(self.model)[pick % len(self.model)]
        m = self.model[s]
        n = min(n, m.length)
        snap = self.pool.snapshot(s, n)
        if -(-n // PS) > self.free_pages():
            self.refused(CapacityError, self.pool.restore, snap)
            return
        t = self.pool.restore(snap)
        c = Seq(self.fmts)
        c.take(m, n)
        c.length = n
        c.pages = [next(_tokens) for _ in range(-(-n // PS))]
        c.ids, c.extra, c.keyed = m.ids[:n], m.extra, False    # a restore carries no ids
        self.model[t] = c

    @precondition(lambda self: any(m.length for m in self.model.values()))
    @rule(layer=st.integers(0, L - 1), seed=st.integers(0, 2**32 - 1))
    def attend(self, layer, seed):
        """Batched attention over the sequences with positions and nothing pending in the
        layer equals, bit for bit, attention on a KVCache restored from the model's codes."""
        seqs = [s for s, m in sorted(self.model.items()) if m.length and not m.pending[layer]]
        if not seqs:
            return
        q = np.random.default_rng(seed).standard_normal((len(seqs), H, D)).astype(np.float32)
        out = kvcore.decode_attention(q, self.pool, layer, seqs=seqs)
        for b, s in enumerate(seqs):
            m = self.model[s]
            n = m.length
            parts = m.parts(n)
            cache = KVCache(self.spec)
            cache.restore(Snapshot(self.spec, n, **parts))
            assert out[b].tobytes() == kvcore.decode_attention(q[b], cache, layer).tobytes()

    # -------------------------------------------------------------- invariants

    @invariant()
    def pages_add_up(self):
        t = self.pool._table
        holders = [0] * P
        for seq in t.seqs.values():
            for g in seq.pages:
                holders[g] += 1
        assert t.refs == holders
        assert sorted(t.free) == [g for g in range(P) if holders[g] == 0]
        assert self.pool.num_free_pages + self.pool.num_used_pages == P
        assert self.pool.num_free_pages == self.free_pages()
        assert sorted(t.seqs) == sorted(self.model)

    @invariant()
    def kept_block_tables_are_fresh(self):
        """The block tables the table keeps between attention calls (PageTable.batch) are
        those of its sequences now: page lists, lengths, pending counts, first held."""
        t = self.pool._table
        kept = t._batch
        if kept is None:
            return
        for b, s in enumerate(kept.ids):
            seq = t.seqs[s]          # a freed sequence drops them
            n = len(seq.pages)
            assert kept.pages[b, :n].tolist() == seq.pages and (kept.pages[b, n:] == -1).all()
            assert (kept.npages[b], kept.lengths[b], kept.starts[b]) == (n, seq.length, seq.start)
            assert kept.pending[:, b].tolist() == seq.pending

    @invariant()
    def reads_back_what_was_written(self):
        pool = self.pool
        for s, m in self.model.items():
            assert pool.length(s) == m.length
            for layer in range(L):
                assert pool.pending(s, layer) == m.pending[layer]
                end = m.length + m.pending[layer]
                assert len(pool.page_table(s)) >= -(-end // PS)
                kc, vc, ks, vs = pool._gather(s, layer, pending=True)
                assert kc.tobytes() == m.codes["k"][layer, :end].tobytes()
                assert vc.tobytes() == m.codes["v"][layer, :end].tobytes()
                for got, want in ((ks, m.scales["k"]), (vs, m.scales["v"])):
                    assert (got is None if want is None
                            else got.tobytes() == want[layer, :end].tobytes())


class PrefixMachine(PoolMachine):
    """The same machine over a pool with a prefix cache (subclassed once per format). Every
    position's K/V is a function of its sequence's extras and token ids up to it (`kv`),
    so the model knows what a matched page must hold. Sequences commit with their token
    ids (a vocabulary of 2, so that prefixes repeat); new rules: match (the longest cached
    prefix of a known or random prompt, under one of three extras) and free into the
    cache; the pool's few pages make writes evict. Invariants added: free + cached +
    in-use = P (a page held twice counts once), cached = registered and unheld, every
    registered page holds exactly the K/V of the prefix its key names (the cache never
    lies), eviction counts as predicted."""

    EXTRAS = [None, {"adapter": "x"}, {"salt": "x"}]

    def __init__(self):
        super().__init__()
        self.pool = KVPool(self.spec, num_pages=P, page_size=PS, prefix_cache=True)
        self.prefixes = {}         # key -> the token ids it names (every committed page)
        self._kv = {}

    def kv(self, extra, ids, layer):
        """K and V [H, D] of the last of `ids` under `extra`: float16-exact float32."""
        memo = (repr(extra), tuple(ids), layer)
        if memo not in self._kv:
            seed = hashlib.sha256(repr(memo).encode()).digest()
            rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
            x = rng.standard_normal((2, H, D)) * 10.0 ** rng.uniform(-2, 2)
            self._kv[memo] = x.astype(np.float16).astype(np.float32)
        return self._kv[memo]

    def write_data(self, rng, s, layer, end, t):
        m = self.model[s]
        while len(m.ids) < end + t:            # pending tokens, shared by every layer
            m.ids.append(int(rng.integers(2)))
        kv = [self.kv(m.extra, m.ids[:p + 1], layer) for p in range(end, end + t)]
        kv = np.stack(kv, axis=1) if kv else np.zeros((2, 0, H, D), np.float32)
        return kv[0], kv[1]

    def holders(self):
        count = {}
        for seq in self.pool._table.seqs.values():
            for g in seq.pages:
                count[g] = count.get(g, 0) + 1
        return count

    def page_list(self, s):
        return self.pool._table.seqs[s].pages

    def track_pages(self, m, first, last):
        pass                       # the pool's own tables (checked by the invariants)

    def batch(self, layer, seqs, counts, seed):
        """As PoolMachine's; cached pages are evicted only for the pages past the free ones."""
        before = self.pool.stats
        need = sum(need for need, _ in self.plans(layer, seqs, counts))
        took = super().batch(layer, seqs, counts, seed)
        if took:
            assert self.pool.stats.evictions - before.evictions == max(0, need - before.free)
        return took

    def pool_advance(self, seqs=None):
        targets = (sorted(self.model) if seqs is None else [seqs] if isinstance(seqs, int)
                   else seqs)
        tokens = [self.model[s].ids[self.model[s].length:
                                    self.model[s].length + self.model[s].pending[0]]
                  for s in targets]
        out = self.pool.advance(seqs, tokens=tokens[0] if isinstance(seqs, int) else tokens)
        for s, t in zip(targets, tokens):
            m = self.model[s]
            if m.keyed:
                ids = m.ids[:m.length + len(t)]
                for i, key in enumerate(prefix_keys(ids, PS, m.extra)):
                    self.prefixes[key] = ids[:(i + 1) * PS]
        return out

    def state(self):
        idx = self.pool._table.prefix
        return super().state() + (dict(idx.by_key), list(idx.lru), idx.hits, idx.misses,
                                  idx.evictions)

    @precondition(lambda self: len(self.model) < 4)
    @rule(data=st.data(), extra=st.integers(0, 2), tail=st.integers(0, 4),
          seed=st.integers(0, 2**32 - 1))
    def match(self, data, extra, tail, seed):
        """match_prefix of a live sequence's ids (or a random prompt) plus `tail` more."""
        rng = np.random.default_rng(seed)
        live = [m for m in self.model.values() if m.length]
        base = data.draw(st.sampled_from(live)).ids[:N] if live and rng.integers(4) else []
        tokens = (list(base) + rng.integers(0, 2, tail).tolist())[:N]
        self.match_tokens(tokens, extra)

    def match_tokens(self, tokens, extra):
        """match_prefix(tokens, EXTRAS[extra]), checked, and the new sequence modelled."""
        before = self.pool.stats
        s, n = self.pool.match_prefix(tokens, extra=self.EXTRAS[extra])
        assert n % PS == 0 and n <= max(0, len(tokens) - 1)
        self.check_counts(before, self.pool.stats, tokens, n)
        for i, key in enumerate(prefix_keys(tokens[:n], PS, self.EXTRAS[extra])):
            self.prefixes[key] = tokens[:(i + 1) * PS]     # pages a store load registered
        m = Seq(self.fmts)
        m.ids, m.extra, m.length = tokens[:n], self.EXTRAS[extra], n
        for layer in range(L):      # what its pages must hold, from its tokens alone
            for p in range(n):
                codes, scales = self.encode(*self.kv(m.extra, tokens[:p + 1], layer)[:, None])
                for i, w in enumerate("kv"):
                    m.codes[w][layer, p] = codes[i][0]
                    if m.scales[w] is not None:
                        m.scales[w][layer, p] = scales[i][0]
        self.model[s] = m

    def check_counts(self, before, after, tokens, n):
        assert after.hits - before.hits == n // PS
        assert after.misses - before.misses == max(0, (len(tokens) - 1) // PS) - n // PS
        assert after.evictions == before.evictions

    @invariant()
    def pages_add_up(self):
        t, idx = self.pool._table, self.pool._table.prefix
        holders = [0] * P
        for seq in t.seqs.values():
            for g in seq.pages:
                holders[g] += 1
        assert t.refs == holders
        st_ = self.pool.stats
        assert st_.free + st_.cached + st_.in_use == P
        assert st_.in_use == sum(1 for h in holders if h) == self.pool.num_used_pages
        assert not set(t.free) & set(idx.lru) and len(set(t.free)) == len(t.free)
        assert sorted(t.free + list(idx.lru)) == [g for g in range(P) if holders[g] == 0]
        assert set(idx.lru) == {g for g in idx.entries if holders[g] == 0}
        assert {g: e.key for g, e in idx.entries.items()} == {g: k for k, g in idx.by_key.items()}
        assert sorted(t.seqs) == sorted(self.model)

    @invariant()
    def cache_never_lies(self):
        """Every registered page holds exactly the K/V of the prefix its key names."""
        idx = self.pool._table.prefix
        for g, e in idx.entries.items():
            ids = self.prefixes[e.key]
            assert np.array(ids[-PS:], "<i8").tobytes() == e.ids
            rows = np.arange(g * PS, (g + 1) * PS)
            for layer in range(L):
                got = self.pool._store.gather(layer, rows)
                extra = next(x for x in self.EXTRAS if encode_extra(x) == e.extra)
                for j, p in enumerate(range(len(ids) - PS, len(ids))):
                    codes, scales = self.encode(*self.kv(extra, ids[:p + 1], layer)[:, None])
                    assert got[0][j].tobytes() == codes[0][0].tobytes()
                    assert got[1][j].tobytes() == codes[1][0].tobytes()
                    for i in range(2):
                        if scales[i] is not None:
                            assert got[2 + i][j].tobytes() == scales[i][0].tobytes()


class StorePrefixMachine(PrefixMachine):
    """PrefixMachine with a chunk store in a directory attached to the prefix cache
    (chunks of 2 pages) and a StoreWriter saving the chunks each advance completes
    (flushed after it, so that the run is deterministic): a match may now continue in
    the store, whatever the pool evicted. Added: pages found in memory plus pages loaded
    equal the positions matched, and the matched sequence holds exactly the K/V of its
    tokens (the model's, from the tokens alone) whichever tier it came from; the cache
    never lies about loaded pages either; no fault."""

    def __init__(self):
        super().__init__()
        from kvcore.store import DirectoryBackend, KVStore, StoreWriter
        self.dir = tempfile.mkdtemp(prefix="kvcore-store-machine-")
        self.store = KVStore(DirectoryBackend(self.dir, fsync=False), model="machine",
                             spec=self.spec, chunk_tokens=2 * PS, page_size=PS)
        self.writer = StoreWriter(self.store)
        self.pool = KVPool(self.spec, num_pages=P, page_size=PS, prefix_cache=True,
                           store=self.store, store_writer=self.writer)
        self.saved = []            # (ids, extra) of sequences whose chunks were saved

    def teardown(self):
        self.writer.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def pool_advance(self, seqs=None):
        out = super().pool_advance(seqs)
        self.writer.flush()
        assert self.writer.stats.failed == 0, self.writer.stats.last_error
        for m in self.model.values():
            if m.keyed and m.length >= 2 * PS and (m.ids[:m.length], m.extra) not in self.saved:
                self.saved.append((m.ids[:m.length], m.extra))
        return out

    @rule(data=st.data(), tail=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def restart(self, data, tail, seed):
        """Another pool over the same store (a restarted or second server: nothing cached
        in memory, every sequence gone), which then matches a saved sequence's ids."""
        self.pool = KVPool(self.spec, num_pages=P, page_size=PS, prefix_cache=True,
                           store=self.store, store_writer=self.writer)
        self.model = {}
        if self.saved:
            self.match_saved(data, tail, seed)

    @precondition(lambda self: self.saved and len(self.model) < 4)
    @rule(data=st.data(), tail=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def match_saved(self, data, tail, seed):
        """match_prefix of a saved sequence's ids plus `tail` more."""
        ids, extra = data.draw(st.sampled_from(self.saved))
        tokens = (ids + np.random.default_rng(seed).integers(0, 2, tail).tolist())[:N]
        self.match_tokens(tokens, self.EXTRAS.index(extra))

    def check_counts(self, before, after, tokens, n):
        loaded = after.store_hits - before.store_hits
        assert after.hits - before.hits + loaded == n // PS
        assert after.misses - before.misses == max(0, (len(tokens) - 1) // PS) - n // PS
        assert after.store_faults == 0, after.last_store_fault


class WindowRules(WindowBooks):
    """The rules of a machine over a pool with a sliding window (WINDOW, SINKS; mixed in
    before PoolMachine or PrefixMachine). The model keeps every position's codes and each
    sequence's first held position (`start`: the window's first page at each commit, as
    docs/design.md says, kept by fork, reset by a truncate into the sink pages); the
    pool's own tables give the pages (a write's page needs). Changed rules: truncate and
    snapshot below what the window needs at the new length are refused (StateError,
    nothing changed); restore keeps the window's pages only; attention runs over the
    pending positions (a step is attended before its advance) and equals, bit for bit, a
    KVCache holding the whole history under the same window. Invariants added: every
    sequence holds exactly the modelled positions (its window's needs and its sink pages
    among them) in held pages, -1 for the others, and reads them back byte for byte;
    held pages per sequence stay within ceil((W + PS - 1) / PS) + 1 + sink pages; no page
    a table names is free or cached; free + cached + in use = P."""

    WINDOW, SINKS, PAGE = 3, 0, PS

    def make_pool(self, **kw):
        return KVPool(self.spec, num_pages=P, page_size=PS, window=self.WINDOW,
                      sink_tokens=self.SINKS, **kw)

    # the pool's own tables give the pages (a -1 is no page)
    def holders(self):
        count = {}
        for seq in self.pool._table.seqs.values():
            for g in seq.pages:
                if g >= 0:
                    count[g] = count.get(g, 0) + 1
        return count

    def page_list(self, s):
        return self.pool._table.seqs[s].pages

    def track_pages(self, m, first, last):
        pass

    def state(self):
        return super().state() + ({s: q.start for s, q in self.pool._table.seqs.items()},)

    def pool_advance(self, seqs=None):
        targets = (sorted(self.model) if seqs is None else [seqs] if isinstance(seqs, int)
                   else list(seqs))
        ends = {s: self.model[s].length + self.model[s].pending[0] for s in targets}
        out = super().pool_advance(seqs)
        for s in targets:
            self.model[s].start = self.slid(ends[s], self.model[s].start)
        return out

    def truncate_to(self, s, n):
        m = self.model[s]
        if 0 <= n <= m.length and not self.may_cut(m, n):
            self.refused(StateError, self.pool.truncate, s, n)
            return
        super().truncate_to(s, n)
        if 0 <= n <= m.length and n <= self.sink_end:
            m.start = 0

    @precondition(lambda self: self.model and len(self.model) < 4)
    @rule(pick=st.integers(0, 3))
    def fork(self, pick):
        s = sorted(self.model)[pick % len(self.model)]
        before = set(self.model)
        super().fork(pick)
        for t in set(self.model) - before:
            self.model[t].start = self.model[s].start

    def match_tokens(self, tokens, extra):
        before = set(self.model)
        super().match_tokens(tokens, extra)
        for t in set(self.model) - before:
            self.model[t].start = self.slid(self.model[t].length, 0)

    @precondition(lambda self: self.model and len(self.model) < 4)
    @rule(pick=st.integers(0, 3), n=st.integers(0, N), through_file=st.booleans())
    def snapshot_restore(self, pick, n, through_file):
        s = sorted(self.model)[pick % len(self.model)]
        m = self.model[s]
        n = min(n, m.length)
        if not self.may_cut(m, n):
            self.refused(StateError, self.pool.snapshot, s, n)
            return
        snap = self.pool.snapshot(s, n)
        assert snap.start == (0 if n <= self.sink_end else m.start)
        assert snap.held == len(self.held(m, n))
        if through_file:
            path = os.path.join(tempfile.mkdtemp(prefix="kvcore-window-"), "s.safetensors")
            snap.save(path)
            snap = kvcore.load_snapshot(path)
            shutil.rmtree(os.path.dirname(path))
        c = Seq(self.fmts)
        c.length, c.start = n, self.slid(n, snap.start)
        need = len({p // PS for p in self.held(c)})
        if need > self.free_pages():
            self.refused(CapacityError, self.pool.restore, snap)
            return
        t = self.pool.restore(snap)
        c.take(m, n)
        c.ids, c.extra, c.keyed = m.ids[:n], m.extra, False    # a restore carries no ids
        self.model[t] = c

    @precondition(lambda self: any(m.length for m in self.model.values()))
    @rule(layer=st.integers(0, L - 1), seed=st.integers(0, 2**32 - 1))
    def attend(self, layer, seed):
        """The pending positions of a layer attended before their advance: bit for bit a
        KVCache holding every position, under the same window."""
        seqs = [s for s, m in sorted(self.model.items()) if m.pending[layer]]
        if not seqs:
            return
        counts = [self.model[s].pending[layer] for s in seqs]
        q = np.random.default_rng(seed).standard_normal((sum(counts), H, D)).astype(np.float32)
        out = kvcore.decode_attention(q, self.pool, layer, seqs=seqs, counts=counts)   # the pool's window
        at = 0
        for s, t in zip(seqs, counts):
            m = self.model[s]
            n = m.length + t
            parts = m.parts(n)
            cache = KVCache(self.spec)
            cache.restore(Snapshot(self.spec, n, **parts))
            want = kvcore.decode_attention(q[at:at + t], cache, layer, window=self.WINDOW,
                                           sink_tokens=self.SINKS)
            assert out[at:at + t].tobytes() == want.tobytes()
            at += t

    @invariant()
    def pages_add_up(self):
        t, idx = self.pool._table, self.pool._table.prefix
        holders = [0] * P
        for seq in t.seqs.values():
            for g in seq.pages:
                if g >= 0:
                    holders[g] += 1
        assert t.refs == holders
        st_ = self.pool.stats
        assert st_.free + st_.cached + st_.in_use == P
        assert st_.in_use == sum(1 for h in holders if h) == self.pool.num_used_pages
        cached = list(idx.lru) if idx is not None else []
        assert not set(t.free) & set(cached) and len(set(t.free)) == len(t.free)
        assert sorted(t.free + cached) == [g for g in range(P) if holders[g] == 0]
        assert sorted(t.seqs) == sorted(self.model)

    @invariant()
    def holds_what_the_window_needs(self):
        self.check_holdings()

    @invariant()
    def reads_back_what_was_written(self):
        pool = self.pool
        for s, m in self.model.items():
            assert pool.length(s) == m.length
            held = self.held(m)
            for layer in range(L):
                assert pool.pending(s, layer) == m.pending[layer]
                at = held + list(range(m.length, m.length + m.pending[layer]))
                kc, vc, ks, vs = pool._gather(s, layer, pending=True)
                assert kc.tobytes() == m.codes["k"][layer, at].tobytes()
                assert vc.tobytes() == m.codes["v"][layer, at].tobytes()
                for got, want in ((ks, m.scales["k"]), (vs, m.scales["v"])):
                    assert (got is None if want is None
                            else got.tobytes() == want[layer, at].tobytes())


class WindowMachine(WindowRules, PoolMachine):
    """PoolMachine over a pool with a window of 3 (no sink positions)."""

    WINDOW, SINKS = 3, 0

    def __init__(self):
        super().__init__()
        self.pool = self.make_pool()


class WindowPrefixMachine(WindowRules, PrefixMachine):
    """PrefixMachine over a pool with a window of 2 and 1 sink position: windowed
    sequences register their pages before the window releases them, matches keep only
    the window's pages, and the cache never lies (a released page stays its key's)."""

    WINDOW, SINKS = 2, 1

    def __init__(self):
        super().__init__()
        self.pool = self.make_pool(prefix_cache=True)


def test_one_batch_into_a_page_two_sequences_share():
    """The example that found a leak (shrunk by hand): sequences 0 and 3 share page 0
    after a fork and truncates into it, and one append_batch writes to both. Each took a
    copy, and page 0 was left with no holder, off the free list."""
    m = PoolMachine()
    m.two_sequences(a=4, b=0, seed=0)
    m.fork(pick=0)
    m.fork_and_rewrite(back=1, pick=0, which=False, seed=0)
    for pick, cut in ((2, 0), (0, 1), (3, 1)):
        m.truncate(pick=pick, cut=cut, bad=0)
    assert m.batch(0, [3, 0], [1, 1], seed=0)
    m.pages_add_up()
    m.reads_back_what_was_written()


def _machine_test(fmt, base=PoolMachine, examples=EXAMPLES):
    return machine_test(base, f"{base.__name__}_{fmt.replace('/', '_')}", {"FORMAT": fmt},
                        examples, STEPS)


for _fmt in list(FORMATS) + PAIRS:
    globals()[f"TestPool_{_fmt.replace('/', '_')}"] = _machine_test(_fmt)
# The prefix cache's books (match, register, evict, free into the cache) are the same for
# every format; what a format changes is the bytes of a page, which TestPool_<fmt> reads
# back for each. So one format per storage layout: codes only (f16), codes and a float32
# scale per row (int8), packed 4-bit codes with two float16 values per block (q4_1); the
# store and window machines below add bf16 and q8_0.
for _fmt in ("f16", "int8", "q4_1"):
    globals()[f"TestPrefixPool_{_fmt}"] = _machine_test(_fmt, PrefixMachine)
for _fmt in ("int8", "bf16"):
    globals()[f"TestStorePrefixPool_{_fmt}"] = _machine_test(_fmt, StorePrefixMachine,
                                                             max(1, EXAMPLES // 2))
# one format each (the window changes no byte a format stores): within the CI budget
TestWindowPool_f32 = _machine_test("f32", WindowMachine)
TestWindowPrefixPool_q8_0 = _machine_test("q8_0", WindowPrefixMachine)
