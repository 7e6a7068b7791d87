"""K q4_1ch in a GpuKVPool (on a device or under the emulator) under a hypothesis machine,
the CPU KVPool beside it as the oracle, both with a prefix cache of pages of one group and
driven by the same calls: prefills through match_prefix, steps of up to 3 sequences whose
runs cross group and page boundaries (and steps the GPU refuses at advance, a NaN or a
value past q4_1ch's limit in a row, then written again), causal decode attention of each
step's tokens, forks, truncations into open and into complete groups, frees, snapshots
restored into new and existing sequences. After every call: the same page tables, free
list, LRU, keys and counters on both, and every sequence's snapshot (codes, scales and
the open group's float16 residual) byte for byte. A call one pool refuses the other
refuses too."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import kvcore
from kvcore import CapacityError, FormatError, NonFiniteError

from test_gpu_groups import PARTS, POISON, assert_same_seq, dev, keys, spec_of
from test_gpu_prefix import PairRules

pytestmark = pytest.mark.gpu

H, D, HQ, N = 2, 64, 4, 192
PS, PAGES, MAX_SEQ = 32, 10, 4          # pages of one group; at most 4 residuals
# prompts over two shared starts of 80 tokens (2 whole pages and more)
STARTS = [[(7 * i + s) % 5 for i in range(80)] for s in range(2)]


@pytest.fixture(scope="module")
def gpu():
    from kvcore import gpu
    return gpu


class GroupsPairMachine(PairRules):
    """Subclassed per V format (V) and window (WINDOW, SINKS: a sliding-window pool, whose
    pages leave group by group; its truncates and snapshots below what the window needs
    are refused by both), with the gpu module (gpu)."""

    gpu = None
    V = "q4_1"
    WINDOW, SINKS = None, 0
    MAX_LIVE = MAX_SEQ

    def __init__(self):
        super().__init__()
        spec = spec_of(D=D, H=H, Hq=HQ, N=N, v=self.V)
        kw = {"prefix_cache": True, "window": self.WINDOW, "sink_tokens": self.SINKS}
        self.g = self.gpu.GpuKVPool(spec, PAGES, PS, max_batch=3, max_pages_per_seq=N // PS,
                                    max_tokens=80, max_sequences=MAX_SEQ, **kw)
        self.g._data.fill(POISON)
        self.c = kvcore.KVPool(spec, PAGES, PS, **kw)
        self.live: list[int] = []
        self.keep = []                  # device inputs of the step in flight

    def teardown(self):
        self.g.free()

    def snapshots(self):
        return {s: self.c.snapshot(s) for s in self.live}

    def step(self, seqs, counts, tokens, seed, fault=None, attend=False):
        """One step on both pools (begin_step, append and attention per layer, advance).
        fault ("nan", "limit"): first a step whose K holds that value in one row, which the
        GPU refuses at advance and the CPU at append_batch, every sequence unchanged; then
        the step again with good values. A step the GPU refuses at begin_step (no page)
        the CPU refuses too."""
        rng = np.random.default_rng(seed)
        T = sum(counts)
        try:
            self.g.begin_step(seqs, counts)
        except CapacityError:
            kv = np.zeros((T, H, D), np.float32)
            with pytest.raises(CapacityError):
                self.c.append_batch(kv, kv, seqs=seqs, layer=0, counts=counts)
            return
        if self.edges:
            k, v = keys(rng, (2, T, H, D))
        else:
            k, v = (rng.standard_normal((2, T, H, D)) * 2).astype(np.float32)
        if fault:
            before = self.snapshots()
            bad = k.copy()
            bad[tuple(rng.integers(x) for x in bad.shape)] = np.nan if fault == "nan" else 65520.0
            error = NonFiniteError if fault == "nan" else FormatError
            with pytest.raises(error):
                self.c.append_batch(bad, v, seqs=seqs, layer=0, counts=counts)
            for layer in range(self.g.spec.num_layers):
                self.keep += [dev(self.gpu, bad), dev(self.gpu, v)]
                self.g.append(layer, self.keep[-2], self.keep[-1])
            with pytest.raises(error):
                self.g.advance(tokens=tokens)
            self.keep.clear()
            for s, snap in before.items():     # both pools as before, byte for byte
                assert_same_seq(self.g, self.c, s)
                after = self.c.snapshot(s)
                assert after.length == snap.length
                for name in PARTS:
                    assert getattr(after, name).tobytes() == getattr(snap, name).tobytes(), name
            self.g.begin_step(seqs, counts)      # its pages are still the sequences'
        q = rng.standard_normal((T, HQ, D)).astype(np.float32)
        buf = self.gpu.DeviceBuffer.alloc(4 * q.size)
        out = buf.view(q.shape, np.float32)
        for layer in range(self.g.spec.num_layers):
            self.keep += [dev(self.gpu, k), dev(self.gpu, v)]
            self.g.append(layer, self.keep[-2], self.keep[-1])
            self.c.append_batch(k, v, seqs=seqs, layer=layer, counts=counts)
            if attend:
                self.keep.append(dev(self.gpu, q))
                self.g.decode_attention(self.keep[-1], out, layer)
                want = kvcore.decode_attention(q, self.c, layer, seqs=seqs, counts=counts)
                err = np.abs(out.to_numpy() - want).max(axis=2)
                assert (err <= self.tolerance(q, layer, seqs, counts)).all()
        assert self.g.advance(tokens=tokens) == list(counts)
        self.c.advance(seqs, tokens=tokens)
        self.keep.clear()
        buf.free()

    def tolerance(self, q, layer, seqs, counts):
        """[R, Hq]: how far two float32 computations of causal attention of the step's
        rows q [R, Hq, D] over `layer` may differ. Each score q . k_j / sqrt(D) is a dot
        product of D terms, whose float32 error in any summation order is at most
        gamma_D * sum_d |q_d k_jd| / sqrt(D) (gamma_D = D u / (1 - D u), u = 2^-24): two
        such differ by delta <= 2 gamma_D * L, L that sum's largest over the row's
        positions; softmax weights then move by a factor within exp(+-2 delta), so the
        output by at most max |v| (exp(2 delta) - 1), plus 3e-5 (1 + max |v|) for the
        rest (exp, the sums of the softmax and of the weighted values). The keys' edge
        rows (values near q4_1ch's limit) make L large, and the bound with it. Under a
        window L and max |v| are taken over every position the sequence holds (more than
        a row sees: a looser bound)."""
        u = 2.0 ** -24
        gamma = D * u / (1 - D * u)
        tol, at = np.empty(q.shape[:2]), 0
        for s, t in zip(seqs, counts):
            k = self.c.dequantize(s, layer, "k", pending=True).astype(np.float64)   # [n, H, D]
            v = self.c.dequantize(s, layer, "v", pending=True)
            n = len(k)
            for r in range(t):
                seen = slice(0, n if self.WINDOW else n - t + r + 1)
                qr = np.abs(q[at + r].astype(np.float64)).reshape(H, HQ // H, D)
                L = np.einsum("hgd,jhd->hgj", qr, np.abs(k[seen])).max(axis=2).reshape(HQ)
                L /= np.sqrt(D)
                vmax = np.abs(v[seen]).max()
                tol[at + r] = vmax * np.expm1(np.minimum(4 * gamma * L, 50.0)) + 3e-5 * (1 + vmax)
            at += t
        return tol

    # -- the rules ---------------------------------------------------------------------

    @initialize(edges=st.booleans())
    def data(self, edges):
        """K/V of an example: test_gpu_groups.keys (scales over 2^-8..2^8, outlier
        channels, zero rows, values near q4_1ch's limit: the encoders' edges, compared byte
        for byte, but scores so large that attention is compared loosely, `tolerance`),
        or Gaussian values, under which attention is compared to about 2e-4."""
        self.edges = edges

    @precondition(lambda self: len(self.live) < MAX_SEQ)
    @rule(start=st.integers(0, 1), cut=st.integers(1, 80),
          tail=st.lists(st.integers(0, 4), max_size=40),
          extra=st.sampled_from([None, {"adapter": "x"}]), seed=st.integers(0, 2**32 - 1))
    def prefill(self, start, cut, tail, extra, seed):
        """match_prefix of a prompt over a shared start, then its rest in one step."""
        tokens = STARTS[start][:cut] + tail
        got = self.both(lambda pool: pool.match_prefix(tokens, extra=extra))
        if got[0] != "ok":
            return
        s, n = got[1]
        self.live.append(s)
        if n < len(tokens):
            self.step([s], [len(tokens) - n], [tokens[n:]], seed)

    @precondition(lambda self: len(self.live) < MAX_SEQ)
    @rule()
    def new(self):
        got = self.both(lambda pool: pool.new_sequence())
        self.live.append(got[1])

    @precondition(lambda self: self.live)
    @rule(data=st.data(), counts=st.lists(st.integers(0, 40), min_size=3, max_size=3),
          decode=st.booleans(), fault=st.sampled_from([None, None, None, "nan", "limit"]),
          attend=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def steps(self, data, counts, decode, fault, attend, seed):
        """A step of 1-3 sequences: decode (one token each) or runs of up to 40."""
        seqs = data.draw(st.lists(st.sampled_from(self.live), min_size=1, max_size=3, unique=True))
        counts = [1] * len(seqs) if decode else counts[:len(seqs)]
        if not sum(counts) or any(self.c.length(s) + c > N for s, c in zip(seqs, counts)):
            return
        rng = np.random.default_rng(seed)
        tokens = [rng.integers(0, 5, c).tolist() for c in counts]
        self.step(seqs, counts, tokens, seed, fault, attend)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), back=st.integers(0, 40))
    def truncate(self, data, back):
        """Into the open group, a complete one (decoded into the residual), or a page."""
        s = data.draw(st.sampled_from(self.live))
        n = max(0, self.c.length(s) - back)
        self.both(lambda pool: pool.truncate(s, n))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(0, N), over=st.booleans())
    def restore(self, data, n, over):
        """A snapshot of n positions of one sequence, into a new one or over another."""
        s = data.draw(st.sampled_from(self.live))
        got = self.both(lambda pool: pool.snapshot(s, min(n, self.c.length(s))).length)
        if got[0] != "ok":                  # below what a window needs: refused by both
            return
        snap = self.c.snapshot(s, min(n, self.c.length(s)))
        if over:
            t = data.draw(st.sampled_from(self.live))
            self.both(lambda pool: pool.restore(snap, seq=t))
        elif len(self.live) < MAX_SEQ:
            got = self.both(lambda pool: pool.restore(snap))
            if got[0] == "ok":
                self.live.append(got[1])

    # -- the invariants ----------------------------------------------------------------

    @invariant()
    def the_same_on_both(self):
        gt, ct = self.g._table, self.c._table
        assert gt.refs == ct.refs and gt.free == ct.free
        assert list(gt.prefix.lru) == list(ct.prefix.lru)
        assert gt.prefix.by_key == ct.prefix.by_key
        assert self.g.stats == self.c.stats
        assert sorted(self.live) == sorted(ct.seqs) == sorted(gt.seqs)
        for s in self.live:
            assert_same_seq(self.g, self.c, s)


@pytest.mark.parametrize("v, window", [("q4_1", None), ("q4_0", None), ("q4_1", (20, 3))],
                         ids=["q4_1", "q4_0", "q4_1-window20-sinks3"])
def test_the_gpu_pool_equals_the_cpu_pool_under_a_hostile_sequence_of_calls(gpu, v, window):
    W, S = window or (None, 0)
    machine = type(f"GroupsPairMachine_{v}_{W}", (GroupsPairMachine,),
                   {"gpu": gpu, "V": v, "WINDOW": W, "SINKS": S})
    run = machine.TestCase
    run.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                            derandomize=True, database=None,
                            suppress_health_check=list(HealthCheck))
    run().runTest()
