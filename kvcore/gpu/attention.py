"""Decode attention and RoPE on the GPU, straight from a GpuKVCache.

1. Plan once, run many (FlashInfer's plan()/run()): `AttentionPlan(cache, ...)` validates
   the shapes, picks the kernel (format, head_dim, heads per block), chooses the number of
   splits of the context from the device (SMs x resident blocks) and the batch (slots x
   kv-head groups), never from the capacity, and allocates the split workspace.
   `plan.run(q, out, layer)` only launches (capturable): the split kernel (grid splits x
   kv-head groups x slots) and, with more than one split, the log-sum-exp merge. Lengths
   and slot pointers are read on the device, and each block computes its split's
   positions from its slot's length (cuda/attention.cuh): a split past the length exits
   at once, so the work follows the lengths while the grid stays fixed for graphs.
2. Inputs: q [M, Hq, D] float32, float16 or bfloat16, C-contiguous device array; out
   [M, Hq, D] float32, C-contiguous, 16-byte aligned; lse (optional) [M, Hq] float32, the
   natural-log log-sum-exp of each row's scaled scores (as kvcore.decode_attention's).
   Slot m attends to positions [0, lengths[m] + pending) of `layer`, where pending (0 or
   1) counts the position that `append` wrote for this step before `advance` commits it.
   A slot with no position gives zeros (lse -inf).
3. Supported: every format, head_dim a multiple of 16 up to 256 (HEAD_DIMS; 64, 128 and
   256 have their own compiled instances, the others share one taking D at run time),
   any GQA ratio (query heads of one kv head are processed 8, 4, 2 or 1 per block; the
   K/V rows are read once per block). The same kernel serves GpuKVPool (kvcore/gpu/pool.py)
   through its paged storage.
4. `apply_rope(q, cache, k=...)` rotates q (and k) in place at each slot's position
   lengths[m] + offset, read on the device; angles in float64 (cuda/rope.cu).
5. Variants (docs/variants.md): window, sink_tokens, sinks, softcap, checked once by
   `check_variants` (plan construction; the pool's decode_attention before it launches)
   and passed to the same kernels as run-time arguments (0 / null: off), never as other
   instances. A window caps the splits at what the query sees (W + S positions).
"""
from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._validate import check_index
from ..attention import _check_variants as _cpu_check_variants
from ..errors import DTypeError, FormatError, RangeError, ShapeError, StateError
from ..formats import PAIR_SEP
from . import driver, kernels
from .memory import DeviceArray, DeviceBuffer, as_device_array

if TYPE_CHECKING:
    from typing import Any

HEAD_DIMS = tuple(range(16, 257, 16))   # head_dims of the decode kernel (q8_0, q4_0, q4_1: % 32 too)
_FIXED_HEAD_DIMS = (64, 128, 256)         # compiled for exactly that D; others: the _dx instance
THREADS = 128               # threads per block of the split kernel
TILE_BYTES = 4096           # K codes per tile (cuda/attention.cuh KV_TILE_BYTES)
MAX_TILE = 64               # positions per tile at most (KV_MAX_TILE)
MIN_SPLIT_POSITIONS = 128   # a split covers at least this many positions (KV_MIN_SPLIT)
MAX_SPLITS = 256
MAX_GRID_Z = 65535          # slots are the split kernel's gridDim.z
_ROPE_STYLES = {"norm": 0, "neox": 1}
_LOG2E = 1.4426950408889634
_INT32_MAX = 2**31 - 1


class Variants(NamedTuple):
    """The attention variants of docs/variants.md, checked (`check_variants`): window W and
    sink_tokens S ints (0: off; held to the int32 range, which changes nothing: no row
    holds more positions), softcap c a float (0.0: off), sinks None, a host float32 [Hq]
    array or a DeviceArray float32 [Hq] (natural-log sink logits)."""
    window: int = 0
    sink_tokens: int = 0
    softcap: float = 0.0
    sinks: "Any" = None

    @property
    def visible(self) -> int | None:
        """The most positions a query sees (W + S), None without a window."""
        return min(self.window + self.sink_tokens, _INT32_MAX) if self.window else None

    @property
    def any(self) -> bool:
        return bool(self.window or self.softcap or self.sinks is not None)

    def launch_args(self, sinks_ptr: int) -> list:
        """The kernel's variant arguments: window, sink_tokens, softcap2 = c log2(e)
        (float32, the kernel's base-2 scores), sinks (device address, 0: none)."""
        return [(self.window, ctypes.c_int), (self.sink_tokens, ctypes.c_int),
                (float(np.float32(self.softcap * _LOG2E)), ctypes.c_float), (sinks_ptr, None)]

    def describe(self) -> str:
        parts = [f"window={self.window}"] if self.window else []
        if self.sink_tokens:
            parts.append(f"sink_tokens={self.sink_tokens}")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.sinks is not None:
            parts.append("sinks=[...]")
        return ", ".join(parts)


NO_VARIANTS = Variants()


def check_variants(spec, *, window=None, sink_tokens=0, sinks=None, softcap=None,
                   causal: bool = True, stream=None, ctx=None) -> Variants:
    """The variants checked as the CPU decode_attention checks them (its own helper,
    kvcore.attention._check_variants: one rule, one message form; nothing is changed or
    launched when one is refused): window None or an int >= 1, causal only; sink_tokens
    an int >= 0, only with a window; softcap None or a finite float32 > 0; sinks None, a
    host array float32 [Hq] (float16 / bfloat16 converted, exactly) of finite values,
    copied, or a device array float32 [Hq], C-contiguous, used in place (read by every
    launch; its values are not checked on the device, as q's are not). DTypeError for a
    type or dtype, RangeError for a value or a combination refused, ShapeError for a
    shape, NonFiniteError for a non-finite sink."""
    device_sinks = sinks is not None and _on_device(sinks)
    var = _cpu_check_variants(spec, causal, window, sink_tokens,
                              None if device_sinks else sinks, softcap)
    if device_sinks:
        sinks = _check_device_sinks(sinks, spec.num_heads, stream, ctx)
    else:
        sinks = var.sinks
    with np.errstate(over="ignore"):
        capped = np.float32(var.softcap * _LOG2E)
    if not math.isfinite(capped):
        raise RangeError(f"softcap must be a finite float32 > 0 whose product with log2(e) "
                         f"is finite too (the GPU kernel's base-2 scores), got {softcap!r}")
    return Variants(min(var.window, _INT32_MAX), min(var.sink_tokens, _INT32_MAX),
                    var.softcap, sinks)


def _on_device(x) -> bool:
    """Whether x is a device array (kvcore's, CUDA array interface, or DLPack on CUDA)."""
    if isinstance(x, (DeviceArray, DeviceBuffer)):
        return True
    if isinstance(x, np.ndarray):
        return False
    try:
        if getattr(x, "__cuda_array_interface__", None) is not None:
            return True
    except (TypeError, RuntimeError):
        return True   # torch: a CUDA tensor it cannot export that way (bfloat16, grad)
    try:
        return hasattr(x, "__dlpack_device__") and int(x.__dlpack_device__()[0]) in (2, 13)
    except Exception:
        return False


def _check_device_sinks(sinks, hq: int, stream, ctx) -> DeviceArray:
    """The DeviceArray of device sinks: float32 [hq], C-contiguous, 4-byte aligned."""
    a = as_device_array(sinks, "sinks", stream=stream, ctx=ctx)
    if a.dtype != np.float32:
        raise DTypeError(f"invalid dtype of sinks: expected float32 for a device array (a host "
                         f"array of float16 or bfloat16 is converted), got {a.dtype}")
    _check_array("sinks", a, (hq,))
    if a.ptr % 4:
        raise ShapeError(f"invalid address of sinks: 0x{a.ptr:x} is not 4-byte aligned")
    return a


def splits_bound(max_length: int | None, variants: Variants) -> int | None:
    """The bound of the positions any query sees, for choose_splits: max_length, W + S
    with a window, the smaller of both; None when neither bounds them."""
    bounds = [b for b in (max_length, variants.visible) if b is not None]
    return min(bounds) if bounds else None


def heads_per_block(group: int) -> int:
    """Query heads one block handles: the largest of 8, 4, 2, 1 dividing the GQA ratio."""
    return next(b for b in (8, 4, 2, 1) if group % b == 0)


def tile_positions(fmt, head_dim: int) -> int:
    """Positions per tile of the split kernel at head_dim >= 64 (4 KiB of K codes, 2 KiB
    for the 4-bit formats, at most 64 positions: cuda/attention.cuh AttnCfg::tile)."""
    return min(TILE_BYTES // fmt.pack // fmt.code_row_bytes(head_dim), MAX_TILE)


def choose_splits(blocks: int, resident: int, max_length: int | None = None) -> int:
    """Splits of the context for `blocks` (query row, kv-head group) pairs when `resident`
    blocks fit on the GPU at once: the fewest splits whose waves of blocks keep 90% of the
    GPU busy (a count of blocks just past a multiple of `resident` would leave it idle for
    most of a wave), else the busiest count, at most MAX_SPLITS. Lengths are not needed:
    each block takes ceil(n / splits) of its row's n positions, at least
    MIN_SPLIT_POSITIONS, on the device, so short rows leave later splits empty (they exit
    at once). max_length, an optional bound of every n, caps the splits to those that can
    hold positions."""
    cap = MAX_SPLITS if max_length is None else max(1, min(MAX_SPLITS, -(-max_length // MIN_SPLIT_POSITIONS)))
    best, best_eff = 1, 0.0
    for s in range(1, cap + 1):
        total = blocks * s
        eff = total / (-(-total // resident) * resident)  # busy fraction of the waves
        if eff >= 0.9:
            return s
        if eff > best_eff:
            best, best_eff = s, eff
    return best


def check_head_dim(head_dim: int, what: str) -> None:
    """FormatError naming the supported head_dims unless the decode kernel takes head_dim."""
    if head_dim not in HEAD_DIMS:
        raise FormatError(f"{what} needs head_dim a multiple of 16 from 16 to 256, got {head_dim}")


GROUPED_HEAD_DIMS = (32, 64, 128, 256)   # K q4_1ch: a row's threads (D / 8) divide a warp


def check_grouped_k(spec, what: str) -> None:
    """FormatError for what the K q4_1ch kernels do not take (cuda/attention.cuh: a tile
    is one group, its threads' partial dots summed by shuffles): a head_dim other than
    GROUPED_HEAD_DIMS. Every other K format passes."""
    if not spec.k_fmt.group:
        return
    if spec.head_dim not in GROUPED_HEAD_DIMS:
        raise FormatError(f"{what}: K format {spec.k_format} needs head_dim 32, 64, 128 or 256 "
                          f"on the GPU, got {spec.head_dim} (decode attention on the CPU takes "
                          f"any multiple of 32)")


def split_kernel(fmt_name: str, head_dim: int, group: int, ctx, *, paged: bool):
    """(function, heads per block, resident blocks on the device) of the split kernel for
    a GpuKVCache (paged=False) or a GpuKVPool (paged=True); fmt_name: a format, or a K/V
    pair "<k>/<v>" (module attention_<k>_<v>)."""
    gb = heads_per_block(group)
    d = head_dim if head_dim in _FIXED_HEAD_DIMS else "x"
    name = fmt_name.replace(PAIR_SEP, "_")
    fn = kernels.function(f"attention_{name}", f"kv_{'pattn' if paged else 'attn'}_{name}_d{d}_g{gb}", ctx)
    with ctx:
        per_sm = driver.call("cuOccupancyMaxActiveBlocksPerMultiprocessor", fn.handle, THREADS, 0)
    return fn, gb, max(1, per_sm) * ctx.sm_count


def check_lse(lse, rows: int, hq: int, stream, ctx) -> int:
    """Device address of an optional lse output float32 [rows, hq], C-contiguous (0: None)."""
    if lse is None:
        return 0
    a = as_device_array(lse, "lse", stream=stream, ctx=ctx)
    _check_array("lse", a, (rows, hq))
    if a.dtype != np.float32:
        raise DTypeError(f"invalid dtype of lse: expected float32, got {a.dtype}")
    return a.ptr


def _input_dtype_id(name: str, x: DeviceArray) -> int:
    try:
        return kernels.INPUT_DTYPES[x.dtype.name]
    except KeyError:
        raise DTypeError(f"invalid dtype of {name}: expected float32, float16 or bfloat16, "
                         f"got {x.dtype}") from None


def _check_array(name: str, x: DeviceArray, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise ShapeError(f"invalid shape of {name}: expected [{', '.join(map(str, shape))}], "
                         f"got [{', '.join(map(str, x.shape))}]")
    if not x.is_c_contiguous:
        raise ShapeError(f"invalid layout of {name}: expected C-contiguous, got strides "
                         f"{list(x.strides)} bytes")


class AttentionPlan(driver.DeviceOwner):
    """Decode attention over every slot of one GpuKVCache (any layer), planned once.

    cache: the GpuKVCache; q_dtype: "float32", "float16" or "bfloat16" (the dtype of the q
    given to run); max_length: an optional upper bound of every slot's length while the
    plan is used, which only caps the number of splits (the default plans from the
    device and the batch alone); scale: the softmax scale (default 1/sqrt(head_dim));
    num_splits: force the number of splits (tests, tuning).
    Variants (docs/variants.md; every run of the plan applies them): window (an int >= 1:
    the query, at the slot's last position, sees its last `window` positions), sink_tokens
    (the first S positions stay visible beside the window), sinks (float32 [Hq] sink
    logits: a host array, copied to the device by the plan, or a device array float32
    [Hq], read in place by every run: rewrite it between runs or graph replays),
    softcap (scores become c tanh(s / c)); see check_variants. A window caps the splits
    at W + S positions.
    The plan owns its workspace; `free()` releases it (also when garbage-collected).
    Not copyable nor picklable (DeviceCopyError): make another plan.
    """

    _holds = "device memory (its split workspace)"
    _move = ("make another instead: AttentionPlan(cache, ...) (a plan holds no KV content; "
             "move that with cache.snapshot(slot) and restore())")

    def __init__(self, cache, *, q_dtype: str = "float16", max_length: int | None = None,
                 scale: float | None = None, num_splits: int | None = None,
                 window: int | None = None, sink_tokens: int = 0, sinks=None,
                 softcap: float | None = None):
        spec = cache.spec
        self._ws = self._sinks_buf = None
        check_head_dim(spec.head_dim, "GPU decode attention")
        if q_dtype not in kernels.INPUT_DTYPES:
            raise DTypeError(f"invalid q_dtype: expected float32, float16 or bfloat16, got {q_dtype!r}")
        self.variants = check_variants(spec, window=window, sink_tokens=sink_tokens,
                                       sinks=sinks, softcap=softcap, stream=cache.stream,
                                       ctx=cache.ctx)
        check_grouped_k(spec, "GPU decode attention")
        self.cache = cache
        self.ctx = cache.ctx
        self.generation = cache.generation
        self.q_dtype = q_dtype
        M, Hkv, Hq, D = cache.slots, spec.num_kv_heads, spec.num_heads, spec.head_dim
        if M > MAX_GRID_Z:
            raise ShapeError(f"GPU decode attention takes at most {MAX_GRID_Z} slots (they are "
                             f"the grid's z dimension), the cache has {M}: split the batch "
                             f"over several caches")
        self.shape = (M, Hq, D)
        self.group = spec.group_size
        self.scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        if not math.isfinite(self.scale):
            raise ShapeError(f"invalid scale: expected a finite float, got {scale!r}")
        ctx = cache.ctx
        self._fn, self.gb, self.resident = split_kernel(spec.format, D, self.group, ctx, paged=False)
        self._fn_merge = kernels.function("attention", "kv_attn_merge", ctx)
        self.blocks = M * Hkv * (self.group // self.gb)
        bound = None if max_length is None else max(1, check_index("max_length", max_length, spec.capacity + 1))
        if num_splits is None:
            self.num_splits = choose_splits(self.blocks, self.resident,
                                            splits_bound(bound, self.variants))
        else:
            self.num_splits = check_index("num_splits", num_splits, MAX_SPLITS + 1)
            if self.num_splits == 0:
                raise ShapeError("invalid num_splits: expected 1 <= num_splits <= 256, got 0")
        self._ws_o = self._ws_lse = 0
        sinks = self.variants.sinks
        if isinstance(sinks, np.ndarray):          # the plan's own copy on the device
            self._sinks_buf = DeviceBuffer.from_numpy(sinks, ctx=ctx)
            self._sinks_ptr = self._sinks_buf.ptr
        else:                                      # the caller's device array (kept alive)
            self._sinks_ptr = 0 if sinks is None else sinks.ptr
        if self.num_splits > 1:
            n_o = M * Hq * self.num_splits * D
            try:
                self._ws = DeviceBuffer.alloc(4 * (n_o + M * Hq * self.num_splits), ctx=ctx)
            except BaseException:
                if self._sinks_buf is not None:
                    self._sinks_buf.free()
                raise
            self._ws_o = self._ws.ptr
            self._ws_lse = self._ws.ptr + 4 * n_o

    @property
    def workspace_bytes(self) -> int:
        return 0 if self._ws is None else self._ws.nbytes

    @driver.in_context
    def run(self, q, out, layer: int, *, pending: int = 0, lse=None, stream=None) -> None:
        """out = softmax(scale * q K^T) V per slot and query head, for `layer` (launch only;
        capturable). q: [M, Hq, D] of the plan's q_dtype, C-contiguous; out: [M, Hq, D]
        float32, C-contiguous; lse: None or float32 [M, Hq], C-contiguous, gets the natural
        log-sum-exp of each row's scaled scores (-inf for an empty slot). pending: 0 or 1
        uncommitted positions to include."""
        c = self.cache
        if self.freed:
            raise StateError("use of a freed AttentionPlan: make a new plan")
        if c.freed or c.generation != self.generation:
            raise StateError("the plan's GpuKVCache was freed or reallocated: make a new plan")
        layer = check_index("layer", layer, c.spec.num_layers)
        pending = check_index("pending", pending, 2)
        st = c.stream if stream is None else stream
        q = as_device_array(q, "q", stream=st, ctx=c.ctx)
        out = as_device_array(out, "out", stream=st, ctx=c.ctx)
        _check_array("q", q, self.shape)
        _check_array("out", out, self.shape)
        if q.dtype.name != self.q_dtype:
            raise DTypeError(f"invalid dtype of q: expected {self.q_dtype} (the plan's q_dtype), got {q.dtype}")
        if out.dtype != np.float32:
            raise DTypeError(f"invalid dtype of out: expected float32, got {out.dtype}")
        if out.ptr % 16:
            raise ShapeError(f"invalid address of out: 0x{out.ptr:x} is not 16-byte aligned")
        if q.ptr % q.dtype.itemsize:
            raise ShapeError(f"invalid address of q: 0x{q.ptr:x} is not {q.dtype.itemsize}-byte aligned")
        lse_ptr = check_lse(lse, self.shape[0], self.shape[1], st, c.ctx)
        s = c.spec
        storage = [
            (c.k_ptrs(layer).ptr, None), (c.v_ptrs(layer).ptr, None),
            (c.k_scale_ptrs(layer).ptr, None), (c.v_scale_ptrs(layer).ptr, None),
            (c.residual_ptr(layer), None),
            (c.lengths.ptr, None), (pending, ctypes.c_int), (s.capacity, ctypes.c_int)]
        launch_split(self._fn, self._fn_merge, storage, self.shape, s.num_kv_heads, self.group,
                     self.gb, self.num_splits, q.ptr, kernels.INPUT_DTYPES[self.q_dtype], self.scale,
                     out.ptr, lse_ptr, self._ws_o, self._ws_lse, st,
                     self.variants.launch_args(self._sinks_ptr))
        c.launched_on(st)

    @property
    def freed(self) -> bool:
        return self.generation == -1

    def free(self) -> None:
        """Releases the workspace (idempotent); the plan cannot run afterwards, nor a
        DecodeGraph that captured it replay."""
        for buf in (self._ws, self._sinks_buf):
            if buf is not None:
                buf.free()
        self.generation = -1

    def __repr__(self):
        v = self.variants.describe()
        return (f"AttentionPlan(shape={list(self.shape)}, q_dtype={self.q_dtype}, "
                f"heads_per_block={self.gb}, num_splits={self.num_splits}"
                + (f", {v}" if v else "") + ")")


def launch_split(fn, fn_merge, storage: list, shape: tuple[int, int, int], hkv: int, group: int,
                 gb: int, nsplit: int, q_ptr: int, q_dtype: int, scale: float, out_ptr: int,
                 lse_ptr: int, ws_o: int, ws_lse: int, stream, variant_args: list) -> None:
    """Launches the split kernel `fn` over R = shape[0] query rows, with its storage's
    arguments first (cuda/attention.cuh) and the variants' last (Variants.launch_args),
    then the merge when nsplit > 1."""
    R, Hq, D = shape
    driver.launch(fn, (nsplit, hkv * (group // gb), R), (THREADS, 1, 1), storage + [
        (D, ctypes.c_int), (q_ptr, None), (q_dtype, ctypes.c_int), (Hq, ctypes.c_int),
        (group, ctypes.c_int), (scale * _LOG2E, ctypes.c_float),
        (out_ptr, None), (lse_ptr, None), (ws_o, None), (ws_lse, None), *variant_args,
    ], stream=stream)
    if nsplit > 1:
        driver.launch(fn_merge, (R * Hq, 1, 1), (D, 1, 1), [
            (ws_o, None), (ws_lse, None), (out_ptr, None), (lse_ptr, None),
            (nsplit, ctypes.c_int), (D, ctypes.c_int),
        ], stream=stream)


def decode_attention(q, cache, layer: int, out=None, *, pending: int = 0, scale: float | None = None,
                     stream=None, return_lse: bool = False, window: int | None = None,
                     sink_tokens: int = 0, sinks=None, softcap: float | None = None):
    """One-off decode attention (plans, allocates `out` when None, runs, keeps no plan).
    Not capturable (it allocates): inside graphs use an AttentionPlan. Returns out, a
    DeviceArray float32 [M, Hq, D] when allocated here; with return_lse, (out, lse): lse a
    new DeviceArray float32 [M, Hq], each row's natural-log log-sum-exp of its scaled
    (capped) scores and its sink (-inf for an empty slot without sinks), as the CPU
    decode_attention(..., return_lse=True). window, sink_tokens, sinks, softcap: the
    variants of docs/variants.md, as AttentionPlan takes them (the query of slot m is its
    last position, lengths[m] + pending - 1)."""
    variants = dict(window=window, sink_tokens=sink_tokens, sinks=sinks, softcap=softcap)
    with cache.ctx:
        return _decode_attention(q, cache, layer, out, pending, scale, stream, return_lse, variants)


def _decode_attention(q, cache, layer, out, pending, scale, stream, return_lse, variants):
    st = cache.stream if stream is None else stream
    qa = as_device_array(q, "q", stream=st, ctx=cache.ctx)
    name = qa.dtype.name
    if name not in kernels.INPUT_DTYPES:
        raise DTypeError(f"invalid dtype of q: expected float32, float16 or bfloat16, got {qa.dtype}")
    driver.refuse_while_capturing("decode_attention (it plans and allocates)", st)
    plan = AttentionPlan(cache, q_dtype=name, scale=scale, **variants)
    if out is None:
        buf = DeviceBuffer.alloc(4 * int(np.prod(plan.shape)), ctx=cache.ctx)
        out = buf.view(plan.shape, np.float32)
    lse = None
    if return_lse:
        rows = plan.shape[:2]
        lse = DeviceBuffer.alloc(4 * rows[0] * rows[1], ctx=cache.ctx).view(rows, np.float32)
    try:
        plan.run(qa, out, layer, pending=pending, lse=lse, stream=st)
        driver.call("cuStreamSynchronize", driver.stream_handle(st))  # before freeing the workspace
    finally:
        plan.free()
    return (out, lse) if return_lse else out


def apply_rope(q, cache, *, k=None, theta: float = 10000.0, style: str = "neox",
               rotary_dim: int | None = None, offset: int = 0, stream=None) -> None:
    """Rotates q [M, Hq, D] (and k [M, Hkv, D]) in place, slot m at position
    lengths[m] + offset read on the device (launch only; capturable). q, k: float32,
    float16 or bfloat16 device arrays, last axis contiguous, other strides free.
    style "neox" pairs (i, i + r/2), "norm" pairs (2i, 2i + 1); r = rotary_dim (default
    head_dim), even, <= min(head_dim, 256); dims past r are untouched."""
    s = cache.spec
    if cache.freed:
        raise StateError("use of a freed GpuKVCache")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not 0 <= offset <= s.capacity:
        raise ShapeError(f"invalid offset: expected 0 <= offset <= {s.capacity}, got {offset!r}")
    st = cache.stream if stream is None else stream
    with cache.ctx:
        _rope_launch(q, k, spec=s, ctx=cache.ctx, rows=cache.slots, lengths_ptr=cache.lengths.ptr,
                    offset=int(offset), theta=theta, style=style, rotary_dim=rotary_dim, stream=st)
        cache.launched_on(st)


def _rope_launch(q, k, *, spec, ctx, rows: int, lengths_ptr: int, offset: int, theta: float,
                style: str, rotary_dim: int | None, stream) -> None:
    """The RoPE launch of apply_rope over any storage: q [rows, Hq, D] (and k [rows, Hkv,
    D]), row m at position lengths[m] + offset of the int32 device array at lengths_ptr
    (a GpuKVCache's lengths, or a GpuKVPool's step lengths with offset -1). Checks style,
    rotary_dim, theta and the arrays; call it inside ctx."""
    s = spec
    if style not in _ROPE_STYLES:
        raise ShapeError(f"invalid style: expected 'neox' or 'norm', got {style!r}")
    r = s.head_dim if rotary_dim is None else rotary_dim
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r <= 0 or r % 2 or r > min(s.head_dim, 256):
        raise ShapeError(f"invalid rotary_dim: expected an even int in [2, {min(s.head_dim, 256)}], got {r!r}")
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 1.0):
        raise ShapeError(f"invalid theta: expected a finite number > 1, got {theta!r}")
    args = []
    for name, x, heads in (("q", q, s.num_heads), ("k", k, s.num_kv_heads)):
        if x is None:
            args += [(0, None), (0, ctypes.c_int), (0, ctypes.c_longlong), (0, ctypes.c_longlong), (0, ctypes.c_int)]
            continue
        a = as_device_array(x, name, stream=stream, ctx=ctx)
        dt = _input_dtype_id(name, a)
        isz = a.dtype.itemsize
        if a.shape != (rows, heads, s.head_dim):
            raise ShapeError(f"invalid shape of {name}: expected [{rows}, {heads}, {s.head_dim}], "
                             f"got [{', '.join(map(str, a.shape))}]")
        if a.strides[2] != isz or any(st_ % isz for st_ in a.strides) or a.ptr % isz:
            raise ShapeError(f"invalid strides of {name}: the last axis must be contiguous, got "
                             f"strides {list(a.strides)} bytes for itemsize {isz}")
        args += [(a.ptr, None), (dt, ctypes.c_int), (a.strides[0] // isz, ctypes.c_longlong),
                 (a.strides[1] // isz, ctypes.c_longlong), (heads, ctypes.c_int)]
    fn = kernels.function("rope", "kv_rope", ctx)
    driver.launch(fn, (rows, 1, 1), (128, 1, 1), args + [
        (lengths_ptr, None), (offset, ctypes.c_int), (int(r), ctypes.c_int),
        (_ROPE_STYLES[style], ctypes.c_int), (math.log2(theta), ctypes.c_double),
    ], stream=stream)
