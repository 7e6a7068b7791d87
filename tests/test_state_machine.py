"""Nothing is lost: a hypothesis state machine drives a KVCache of each format (and of the
K/V pairs of tests/_formats.py: each side in its own format) with random
sequences of append, advance, truncate, reset, snapshot (through a file too, which is then
truncated or rewritten under the loaded snapshot) and restore (also of a snapshot built
from the cache's own views), good calls and bad ones of every kind, against a plain numpy
model of the cache.

After every step the views (committed and pending), lengths and dequantized values equal
the model's; after every refused call the storage is byte-identical to before. The model
takes its expected codes and scales from kvcore.quantize of each appended step (the
documented contract of append) and its dequantized values from kvcore.dequantize.

Examples per format: KVCORE_STATE_EXAMPLES (default 40, the CI budget), steps per
example: KVCORE_STATE_STEPS (default 30); e.g. KVCORE_STATE_EXAMPLES=500 for a long run.
"""
import os
import tempfile

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

import kvcore
from kvcore import KVCache, KVSpec, Snapshot, load_snapshot
from kvcore.formats import ROW_FORMATS   # K and V in one format (q4_1ch is K only)
from kvcore.errors import (CapacityError, DTypeError, FormatError, NonFiniteError,
                           OutOfRangeError, ShapeError, SnapshotError, StateError)
from kvcore._quant import input_limit, max_scale

from _formats import PAIRS
from _machines import machine_test, one_thread  # noqa: F401  (one_thread: autouse fixture)

ml_dtypes = pytest.importorskip("ml_dtypes")

EXAMPLES = int(os.environ.get("KVCORE_STATE_EXAMPLES", "40"))
STEPS = int(os.environ.get("KVCORE_STATE_STEPS", "30"))
L, H, D, N = 2, 2, 32, 6
INPUT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
# One value per format that its encoder never produces (a NaN or inf code, code -128,
# a negative scale), placed by the bad-snapshot rule.
IMPOSSIBLE = {"f32": ("k_codes", np.nan), "f16": ("v_codes", np.inf),
              "bf16": ("k_codes", 0x7FC0), "int8": ("v_codes", -128),
              "fp8_e4m3": ("k_codes", 0x7F), "fp8_e5m2": ("v_codes", 0xFC),
              "q8_0": ("k_scales", -1.0), "q4_0": ("k_scales", np.inf),
              "q4_1": ("v_scales", np.inf)}   # q4_0's d and q4_1's m take either sign


def make_input(seed, kind, dtype, t, layout):
    """K or V for one append: [t, H, D] (or [H, D] for layout "2d", t = 1), finite,
    in `dtype`; "strided" gives a non-contiguous view of a larger array."""
    rng = np.random.default_rng(seed)
    shape = (t, H, D)
    if kind == "zeros":
        x = np.zeros(shape)
    elif kind == "heavy":
        x = rng.standard_t(3, shape) * 100
    elif kind == "tiny":
        x = rng.standard_normal(shape) * 1e-30
    else:
        x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3)
    x[rng.random(shape[:2]) < 0.2] = 0  # some all-zero rows
    x = x.astype(np.float32).astype(dtype)
    if layout == "2d":
        return x[0] if t == 1 else x
    if layout == "strided":
        big = np.zeros((t, H, 2 * D), dtype)
        big[:, :, ::2] = x
        return big[:, :, ::2]
    return x


class Model:
    """The cache as plain numpy: per side ("k", "v", each in its own format) full-capacity
    expected codes, scales (None: a format without) and decoded floats per layer, the
    committed length and the pending count per layer."""

    def __init__(self, spec: KVSpec):
        self.fmt = dict(zip("kv", spec.fmts))
        self.S = {w: f.scales_per_row(D) for w, f in self.fmt.items()}
        self.codes = {w: np.zeros((L, N, H, f.code_width(D)), f.code_dtype)
                      for w, f in self.fmt.items()}
        self.scales = {w: np.zeros((L, N, H, self.S[w]), f.scale_dtype) if self.S[w] else None
                       for w, f in self.fmt.items()}
        # what zero bytes decode to (q4_0: (0 - 8) * 0.0 = -0.0)
        self.floats = {w: kvcore.dequantize(self.codes[w], self.scales[w], f)
                       for w, f in self.fmt.items()}
        self.length = 0
        self.pending = [0] * L

    def encode(self, x, which):
        """Expected (codes, scales, decoded) of rows x [..., D] of side `which`:
        kvcore.quantize's."""
        f = self.fmt[which]
        codes, scales = kvcore.quantize(x, f)
        codes = codes.view(f.code_dtype)
        return codes, scales, kvcore.dequantize(codes, scales, f)

    def write(self, layer, pos, which, codes, scales, floats):
        t = codes.shape[0]
        self.codes[which][layer, pos:pos + t] = codes
        if self.S[which]:
            self.scales[which][layer, pos:pos + t] = scales
        self.floats[which][layer, pos:pos + t] = floats

    def set_length(self, n):
        self.length, self.pending = n, [0] * L


class CacheMachine(RuleBasedStateMachine):
    """Subclassed once per format (FORMAT)."""

    FORMAT = "f32"
    snapshots = Bundle("snapshots")

    def __init__(self):
        super().__init__()
        self.spec = KVSpec(num_layers=L, num_kv_heads=H, head_dim=D, capacity=N,
                           format=self.FORMAT)
        self.cache = KVCache(self.spec)
        self.model = Model(self.spec)
        # per side: finite values at or past it are refused
        self.limit = {w: input_limit(f.id) for w, f in zip("kv", self.spec.fmts)}
        self.tmp = tempfile.TemporaryDirectory()
        self.files = 0

    def teardown(self):
        self.tmp.cleanup()

    def refused(self, error, call, *args, **kwargs):
        """Runs a call that must raise `error` and leave the cache exactly as it was."""
        before = self.cache._storage.tobytes()
        length, pending = self.cache.length, [self.cache.pending(i) for i in range(L)]
        with pytest.raises(error):
            call(*args, **kwargs)
        assert self.cache._storage.tobytes() == before
        assert self.cache.length == length
        assert [self.cache.pending(i) for i in range(L)] == pending

    # ---------------------------------------------------------------- appends

    @rule(layer=st.integers(0, L - 1), t=st.integers(0, 3), seed=st.integers(0, 2**32 - 1),
          kind=st.sampled_from(["normal", "zeros", "heavy", "tiny"]),
          kdt=st.sampled_from(INPUT_DTYPES), vdt=st.sampled_from(INPUT_DTYPES),
          layout=st.sampled_from(["contiguous", "strided", "2d"]))
    def append(self, layer, t, seed, kind, kdt, vdt, layout):
        if layout == "2d":
            t = 1
        k = make_input(seed, kind, kdt, t, layout)
        v = make_input(seed + 1, kind, vdt, t, layout)
        m = self.model
        pos = m.length + m.pending[layer]
        if pos + t > N:
            self.refused(CapacityError, self.cache.append, layer, k, v)
            return
        if any(np.abs(x.astype(np.float32)).max(initial=0) >= self.limit[w]
               for w, x in (("k", k), ("v", v))):
            self.refused(FormatError, self.cache.append, layer, k, v)
            return
        self.cache.append(layer, k, v)
        # the rule is on values: float32 holds every input
        for which, x in (("k", k), ("v", v)):
            m.write(layer, pos, which, *m.encode(x.reshape(t, H, D).astype(np.float32), which))
        m.pending[layer] += t

    @rule(layer=st.integers(0, L - 1), seed=st.integers(0, 2**32 - 1),
          fault=st.sampled_from(["layer", "layer type", "heads", "head_dim", "ndim",
                                 "k/v shapes", "float64", "int32", "list", "masked", "nan",
                                 "inf", "-inf", "range", "full"]))
    def append_bad(self, layer, seed, fault):
        rng = np.random.default_rng(seed)
        room = N - self.model.length - self.model.pending[layer]
        t = min(int(rng.integers(1, 3)), room)  # only the fault itself may be wrong
        if t == 0 and fault in ("nan", "inf", "-inf", "range"):
            return
        k = rng.standard_normal((t, H, D)).astype(np.float32)
        v = rng.standard_normal((t, H, D)).astype(np.float32)
        error = {"layer": OutOfRangeError, "layer type": DTypeError, "heads": ShapeError,
                 "head_dim": ShapeError, "ndim": ShapeError, "k/v shapes": ShapeError,
                 "float64": DTypeError, "int32": DTypeError, "list": DTypeError,
                 "masked": DTypeError,
                 "nan": NonFiniteError, "inf": NonFiniteError, "-inf": NonFiniteError,
                 "range": FormatError, "full": CapacityError}[fault]
        if fault == "layer":
            layer = int(rng.choice([-1, L, L + 5]))
        elif fault == "layer type":
            layer = float(layer)
        elif fault == "heads":
            k = v = np.zeros((t, H + 1, D), np.float32)
        elif fault == "head_dim":
            k = v = np.zeros((t, H, D - 1), np.float32)
        elif fault == "ndim":
            k = v = np.zeros((1, t, H, D), np.float32)
        elif fault == "k/v shapes":
            v = np.zeros((t + 1, H, D), np.float32)
        elif fault in ("float64", "int32"):
            k = k.astype(fault)
        elif fault == "list":
            v = v.tolist()
        elif fault == "masked":  # finite data, NaN under the mask: refused, never read
            v = np.ma.masked_array(v, mask=np.zeros(v.shape, bool))
            if t:
                v.data.flat[0], v.mask.flat[0] = np.nan, True
        elif fault in ("nan", "inf", "-inf"):
            target = k if rng.integers(2) else v
            target[tuple(rng.integers(s) for s in target.shape)] = float(fault)
        elif fault == "range":  # a finite value at or past K's format's limit
            if self.limit["k"] == np.inf:
                return
            k[tuple(rng.integers(s) for s in k.shape)] = self.limit["k"] * float(rng.choice([1, -1]))
        else:  # full: one position more than the layer has room for
            k = v = np.zeros((room + 1, H, D), np.float32)
        self.refused(error, self.cache.append, layer, k, v)

    # ---------------------------------------------------------- commit, rollback

    @rule()
    def advance(self):
        m = self.model
        if len(set(m.pending)) > 1:
            self.refused(StateError, self.cache.advance)
            return
        assert self.cache.advance() == m.pending[0]
        m.set_length(m.length + m.pending[0])

    @rule(n=st.integers(-1, N + 1))
    def truncate(self, n):
        if not 0 <= n <= self.model.length:
            self.refused(OutOfRangeError, self.cache.truncate, n)
            return
        self.cache.truncate(n)
        self.model.set_length(n)

    @rule()
    def reset(self):
        self.cache.reset()
        self.model.set_length(0)

    # ------------------------------------------------------ snapshot, restore

    @rule(target=snapshots, n=st.integers(0, N), through_file=st.booleans(),
          afterwards=st.sampled_from(["keep", "truncate", "rewrite"]))
    def snapshot(self, n, through_file, afterwards):
        m = self.model
        if n > m.length:
            self.refused(OutOfRangeError, self.cache.snapshot, n)
            n = m.length
        snap = self.cache.snapshot(n)
        if through_file:
            self.files += 1
            path = os.path.join(self.tmp.name, f"{self.files}.safetensors")
            snap.save(path)
            snap = load_snapshot(path)
            if afterwards == "truncate":  # the loaded snapshot holds its own verified bytes
                os.truncate(path, 8)
            elif afterwards == "rewrite":
                with open(path, "r+b") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(0)
                    f.write(b"\x7f" * size)
        expected = ({w: m.codes[w][:, :n].copy() for w in "kv"},
                    {w: None if m.scales[w] is None else m.scales[w][:, :n].copy() for w in "kv"},
                    {w: m.floats[w][:, :n].copy() for w in "kv"})
        return snap, expected

    @rule(saved=snapshots)
    def restore(self, saved):
        snap, (codes, scales, floats) = saved
        self.cache.restore(snap)
        m = self.model
        n = snap.length
        for w in "kv":
            for layer in range(L):
                m.write(layer, 0, w, codes[w][layer],
                        None if scales[w] is None else scales[w][layer], floats[w][layer])
        m.set_length(n)

    @rule(swap=st.booleans())
    def restore_own_views(self, swap):
        """A snapshot made of views of the cache's own storage (every region at full
        capacity, as `layout` describes it) restores like a copy, K and V swapped too (in
        one format)."""
        c, m = self.cache, self.model
        swap = swap and not self.spec.paired
        parts = {name: c._storage[r["offset"]:r["offset"] + r["nbytes"]]
                 .view(r["dtype"]).reshape(r["shape"]) for name, r in c.layout.items()}
        if swap:
            parts = {("v" if name[0] == "k" else "k") + name[1:]: a for name, a in parts.items()}
        c.restore(Snapshot(self.spec, N, **parts))
        if swap:
            for store in (m.codes, m.floats) + ((m.scales,) if m.S["k"] else ()):
                store["k"], store["v"] = store["v"].copy(), store["k"].copy()
        m.set_length(N)

    @rule(other=st.sampled_from(list(ROW_FORMATS)), n=st.integers(0, N),
          seed=st.integers(0, 2**32 - 1))
    def restore_requantized(self, other, n, seed):
        """A snapshot of another format, re-encoded into the cache's (each side into its
        own)."""
        rng = np.random.default_rng(seed)
        spec = self.spec.replace(format=other)
        x = (rng.standard_normal((2, L, n, H, D)) * 10).astype(np.float32)  # K and V
        codes, scales = kvcore.quantize(x, other)
        codes = codes.view(spec.fmt.code_dtype)
        parts = {"k_codes": codes[0], "v_codes": codes[1]}
        if scales is not None:
            parts.update(k_scales=scales[0], v_scales=scales[1])
        self.cache.restore(Snapshot(spec, n, **parts), requantize=True)
        m = self.model
        decoded = kvcore.dequantize(codes, scales, other)
        for i, w in enumerate("kv"):
            want, want_scales, floats = m.encode(decoded[i], w)
            for layer in range(L):
                m.write(layer, 0, w, want[layer],
                        None if want_scales is None else want_scales[layer], floats[layer])
        m.set_length(n)

    @rule(fault=st.sampled_from(["num_layers", "num_kv_heads", "head_dim", "format",
                                 "too long", "impossible value", "scale past the encoder's"]),
          n=st.integers(0, N))
    def restore_bad(self, fault, n):
        spec = self.spec
        if fault == "num_layers":
            spec = spec.replace(num_layers=L + 1)
        elif fault == "num_kv_heads":
            spec = spec.replace(num_kv_heads=H + 1, num_heads=H + 1)
        elif fault == "head_dim":
            spec = spec.replace(head_dim=2 * D)
        elif fault == "format":
            spec = spec.replace(format="f16" if self.FORMAT != "f16" else "int8")
        elif fault == "too long":
            spec, n = spec.replace(capacity=N + 3), N + 1 + n % 3
        parts = {}
        for w, f in zip("kv", spec.fmts):
            S = f.scales_per_row(spec.head_dim)
            shape = (spec.num_layers, n, spec.num_kv_heads, f.code_width(spec.head_dim))
            parts[f"{w}_codes"] = np.zeros(shape, f.code_dtype)
            if S:
                parts[f"{w}_scales"] = np.zeros(shape[:3] + (S,), f.scale_dtype)
        if fault == "impossible value":   # in the side the format's entry names
            if n == 0:
                return
            w = "k" if self.spec.paired else None
            name, value = IMPOSSIBLE[spec.k_format if w else self.FORMAT]
            name = f"{w}{name[1:]}" if w else name
            parts[name][-1, n - 1, -1, -1] = value
        if fault == "scale past the encoder's":   # finite, but would not decode finite
            top = max_scale(spec.v_fmt.id)
            if n == 0 or not np.isfinite(top):
                return
            parts["v_scales"][0, 0, 0, 0] = np.nextafter(np.float32(top), np.float32(np.inf))
        self.refused(SnapshotError, self.cache.restore, Snapshot(spec, n, **parts))

    # -------------------------------------------------------------- invariant

    @invariant()
    def matches_model(self):
        c, m = self.cache, self.model
        assert c.length == m.length
        for layer in range(L):
            assert c.pending(layer) == m.pending[layer]
            n, end = m.length, m.length + m.pending[layer]
            for w, view, scales in (("k", c.keys, c.key_scales), ("v", c.values, c.value_scales)):
                assert view(layer).tobytes() == m.codes[w][layer, :n].tobytes()
                assert view(layer, pending=True).tobytes() == m.codes[w][layer, :end].tobytes()
                if m.S[w]:
                    assert scales(layer).tobytes() == m.scales[w][layer, :n].tobytes()
                    assert (scales(layer, pending=True).tobytes()
                            == m.scales[w][layer, :end].tobytes())
                else:
                    assert scales(layer) is None
                assert c.dequantize(layer, w).tobytes() == m.floats[w][layer, :n].tobytes()


for _fmt in list(ROW_FORMATS) + PAIRS:
    _name = _fmt.replace("/", "_")
    globals()[f"TestCache_{_name}"] = machine_test(CacheMachine, f"CacheMachine_{_name}",
                                                   {"FORMAT": _fmt}, EXAMPLES, STEPS)
