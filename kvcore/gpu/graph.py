"""DecodeGraph: one decode step of every layer, captured once as a CUDA graph and replayed,
over a GpuKVCache (M slots) or a GpuKVPool (max_batch rows of a paged step).

1. Fixed buffers (graph mode means fixed addresses): the graph owns one device allocation
   holding, per layer, q [R, Hq, D] and k, v [R, Hkv, D] in `dtype`, and out [R, Hq, D]
   float32 (R rows: the cache's slots, or the pool's max_batch). The caller writes q/k/v of the next token between replays and
   reads out.
2. The captured step, on the graph's stream, is for each layer
       RoPE on q and k at each row's new position  (skipped with rope=False)
       append(layer, k, v)                          (one position per row)
       attention(q, out, layer)                     (over the row's positions, the new one included)
   and then the advance. Everything a kernel reads that changes between steps is device
   memory at a fixed address, so the same graph replays step after step:
   - GpuKVCache: positions come from the device lengths; `advance` grows them on the device
     (captured); `active` (int32[M]) selects the slots a replay appends to and commits.
   - GpuKVPool: the host calls `pool.begin_step(seqs)` before each replay (what a graph
     cannot do: take pages, copy shared pages on write, write the block tables, lengths
     and slot mapping in place); row b is seqs[b], rows past them are padding (slot -1,
     length 0: not written, zero output); RoPE reads the step lengths (position
     lengths[b] - 1). The advance is the host's: `pool.advance()` after the replay
     synchronises, raises a device error and commits the positions (nothing to capture).
3. `replay()` refuses (StateError) once the storage's `generation` changed or it was freed
   (the graph holds raw addresses), and over a pool when no step of one position per
   sequence is begun. `step_eager()` launches the same sequence without the graph (for
   comparisons and benchmarks).
4. Errors of the append land in the storage's status; the cache's `check()` (per slot) or
   the pool's `advance()`/`check()` turn them into exceptions.
5. One call at a time (a CallGuard, docs/design.md "Threads"): replay, step_eager and
   destroy refuse a second thread; over a pool, the capture, replay and step_eager also
   hold the pool's guard for the whole step (they read the tables that the pool's host
   calls write) and call the pool's unguarded methods.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .._guard import CallGuard
from .._validate import check_index
from ..errors import DTypeError, SpecError, StateError
from . import driver, kernels
from .attention import AttentionPlan, _rope_launch, apply_rope, check_variants
from .driver import Stream
from .memory import DeviceArray, DeviceBuffer
from .pool import GpuKVPool

_DTYPES = ("float32", "float16", "bfloat16")


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _stale(store, generation: int) -> None:
    if store.freed or store.generation != generation:
        raise StateError(f"the {type(store).__name__} changed since the graph was captured "
                         f"(generation {generation} -> {store.generation}"
                         f"{', freed' if store.freed else ''}): capture a new DecodeGraph")


class _CacheSteps:
    """The storage part of a DecodeGraph over a GpuKVCache: slot m is row m; attention
    through an AttentionPlan (pending=1); advance on the device; runs on its own stream."""

    def __init__(self, cache, dtype: str, scale, max_length, variants: dict):
        self.store, self.rows, self.q_dtype = cache, cache.slots, dtype
        self.plan = AttentionPlan(cache, q_dtype=dtype, scale=scale, max_length=max_length,
                                  **variants)
        self._active = DeviceBuffer.from_numpy(np.ones(cache.slots, np.int32), ctx=cache.ctx)
        self.stream, self.owns_stream = Stream.create(cache.ctx), True
        self.generation = cache.generation

    @property
    def active(self) -> DeviceArray:
        if self._active.freed:
            raise StateError("use of a destroyed DecodeGraph")
        return self._active.view((self.rows,), np.int32)

    def rope(self, q, k, stream, rope: dict) -> None:
        apply_rope(q, self.store, k=k, stream=stream, **rope)

    def append(self, layer: int, k, v, stream) -> None:
        self.store.append(layer, k, v, active=self.active, stream=stream)

    def attend(self, q, out, layer: int, stream) -> None:
        self.plan.run(q, out, layer, pending=1, stream=stream)

    def advance(self, stream) -> None:
        self.store.advance(active=self.active, stream=stream)

    def check_replay(self, stream) -> None:
        if self.plan.freed:
            raise StateError("the DecodeGraph's AttentionPlan was freed: its graph would write "
                             "to the freed workspace; capture a new DecodeGraph")
        _stale(self.store, self.generation)

    def guard(self, op: str):
        """No guard of the cache's own (a GpuKVCache has none)."""
        return contextlib.nullcontext()

    def launched_on(self, stream) -> None:
        self.store.launched_on(stream)

    def release(self) -> None:
        self.plan.free()
        self._active.free()


class _PoolSteps:
    """The storage part of a DecodeGraph over a GpuKVPool: row b is the b-th sequence of the
    step begun by `pool.begin_step` (one position each); runs on the pool's stream, which begin_step synchronises before it
    rewrites the tables; the advance is the host's `pool.advance()`."""

    def __init__(self, pool, dtype, scale, max_length, variants: dict):
        if max_length is not None:
            raise SpecError("max_length applies to a GpuKVCache's AttentionPlan; a GpuKVPool's "
                            "decode reads each row's length on the device")
        self.store, self.rows, self.q_dtype = pool, pool.max_batch, dtype
        self.plan = None
        self._scale = scale
        # checked now (nothing captured when refused); host sinks copied to a buffer of the
        # graph's own, so that the captured decode reads device memory
        v = check_variants(pool.spec, **variants, stream=pool.stream, ctx=pool.ctx)
        self._sinks_buf = None
        sinks = v.sinks
        if isinstance(sinks, np.ndarray):
            self._sinks_buf = DeviceBuffer.from_numpy(sinks, ctx=pool.ctx)
            sinks = self._sinks_buf.view(sinks.shape, np.float32)
        self._variants = dict(window=v.window or None, sink_tokens=v.sink_tokens,
                              softcap=v.softcap or None, sinks=sinks)
        self.stream, self.owns_stream = pool.stream, False
        self.generation = pool.generation

    @property
    def active(self) -> DeviceArray:
        raise StateError("a DecodeGraph over a GpuKVPool has no active set: the step's rows "
                         "are the sequences given to pool.begin_step")

    def rope(self, q, k, stream, rope: dict) -> None:
        p = self.store
        _rope_launch(q, k, spec=p.spec, ctx=p.ctx, rows=self.rows, lengths_ptr=p.lengths.ptr,
                     offset=-1, stream=stream, **rope)

    # the pool's methods without their guard: the graph holds it across the whole step
    def append(self, layer: int, k, v, stream) -> None:
        type(self.store).append.__wrapped__(self.store, layer, k, v, stream=stream)

    def attend(self, q, out, layer: int, stream) -> None:
        type(self.store).decode_attention.__wrapped__(self.store, q, out, layer, scale=self._scale,
                                                      stream=stream, **self._variants)

    def advance(self, stream) -> None:
        """Nothing on the device: the step's lengths are the host's (begin_step)."""

    def check_replay(self, stream) -> None:
        p = self.store
        _stale(p, self.generation)
        if stream is not None and int(driver.stream_handle(stream)) != p.stream.ptr:
            raise StateError("a DecodeGraph over a GpuKVPool replays on the pool's stream (the "
                             "one begin_step orders its table writes on): pass no stream")
        if p._step is None or any(c != 1 for c in p._step[1]):
            got = "no step" if p._step is None else f"counts {p._step[1]}"
            raise StateError(f"a DecodeGraph step over a GpuKVPool needs a step of one position "
                             f"per sequence begun (pool.begin_step(seqs)), got {got}")

    def guard(self, op: str):
        return self.store._guard(op)

    def launched_on(self, stream) -> None:
        """The pool's own stream: its synchronising calls wait for it."""

    def release(self) -> None:
        """The graph's copy of host sinks (the stream is the pool's)."""
        if self._sinks_buf is not None:
            self._sinks_buf.free()


class DecodeGraph(driver.DeviceOwner):
    """A captured decode step over every layer and row of `storage`: a GpuKVCache (row m =
    slot m) or a GpuKVPool (row b = the b-th sequence of `pool.begin_step`, up to
    max_batch).

    dtype: dtype of the q/k/v buffers ("float32", "float16", "bfloat16"); rope: apply RoPE
    (theta, style, rotary_dim as in apply_rope) before the append; scale: softmax scale (default 1/sqrt(head_dim)); max_length: as in
    AttentionPlan (cache only). window, sink_tokens, sinks, softcap: the attention
    variants of docs/variants.md, applied to every layer's attention (checked here: a
    refused one captures nothing); sinks float32 [Hq], a host array (copied to the device
    once) or a device array (read in place by every replay: rewrite it between replays).
    Over a cache the graph runs on its own stream unless
    `stream` is given to replay/step_eager; over a pool on the pool's stream.

    Not copyable nor picklable (DeviceCopyError): capture another over the storage.
    """

    _holds = "device memory (its input and output buffers) and a captured CUDA graph"
    _move = ("capture another instead: DecodeGraph(storage, ...); to move the KV content, "
             "snapshot() the storage and restore() the snapshot into another")

    def __init__(self, storage, *, dtype: str = "float16", rope: bool = True, theta: float = 10000.0,
                 style: str = "neox", rotary_dim: int | None = None, scale: float | None = None,
                 max_length: int | None = None, window: int | None = None, sink_tokens: int = 0,
                 sinks=None, softcap: float | None = None):
        if dtype not in _DTYPES:
            raise DTypeError(f"invalid dtype: expected float32, float16 or bfloat16, got {dtype!r}")
        self.ctx = storage.ctx
        self._guard = CallGuard("DecodeGraph")
        with self.ctx:
            driver.refuse_while_capturing("DecodeGraph()", storage.stream)
            variants = dict(window=window, sink_tokens=sink_tokens, sinks=sinks, softcap=softcap)
            if isinstance(storage, GpuKVPool):
                storage._alive()
                self._steps = _PoolSteps(storage, dtype, scale, max_length, variants)
            else:
                self._steps = _CacheSteps(storage, dtype, scale, max_length, variants)
            with self._steps.guard("DecodeGraph()"):
                self._build(storage, dtype, rope, theta, style, rotary_dim)

    def _build(self, storage, dtype, rope, theta, style, rotary_dim) -> None:
        s = storage.spec
        self.storage = storage
        self.dtype = _np_dtype(dtype)
        q_dtype = _np_dtype(self._steps.q_dtype)
        self._rope = dict(theta=theta, style=style, rotary_dim=rotary_dim) if rope else None
        R, L, Hq, Hkv, D = self._steps.rows, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim
        if rope:
            kernels.function("rope", "kv_rope", storage.ctx)  # load the module before capturing
        q_bytes, kv_bytes = R * Hq * D * q_dtype.itemsize, R * Hkv * D * self.dtype.itemsize
        out_bytes = R * Hq * D * 4
        self._layer_bytes = _align(q_bytes) + 2 * _align(kv_bytes) + _align(out_bytes)
        self._offsets = (0, _align(q_bytes), _align(q_bytes) + _align(kv_bytes),
                         _align(q_bytes) + 2 * _align(kv_bytes))
        self._dtypes = (q_dtype, self.dtype, self.dtype, np.dtype(np.float32))
        self._buf = DeviceBuffer.zeros(L * self._layer_bytes, ctx=storage.ctx)
        self._shapes = ((R, Hq, D), (R, Hkv, D), (R, Hkv, D), (R, Hq, D))
        self.stream = self._steps.stream
        self._graph = self._exec = None  # finalizers (driver.owned_handle) once captured
        self._capture()

    @property
    def plan(self) -> AttentionPlan | None:
        """The AttentionPlan of a graph over a GpuKVCache (None over a pool)."""
        return self._steps.plan

    @property
    def rows(self) -> int:
        """R: the cache's slots, or the pool's max_batch."""
        return self._steps.rows

    # ------------------------------------------------------------------ buffers

    def _view(self, which: int, layer: int) -> DeviceArray:
        if self._buf.freed:
            raise StateError("use of a destroyed DecodeGraph")
        layer = check_index("layer", layer, self.storage.spec.num_layers)
        return self._buf.view(self._shapes[which], self._dtypes[which],
                              offset=layer * self._layer_bytes + self._offsets[which])

    def q(self, layer: int) -> DeviceArray:
        """The q input of `layer`: [R, Hq, D] of the graph's dtype, rotated in place."""
        return self._view(0, layer)

    def k(self, layer: int) -> DeviceArray:
        """The k input of `layer`: [R, Hkv, D] (rotated in place, then appended)."""
        return self._view(1, layer)

    def v(self, layer: int) -> DeviceArray:
        return self._view(2, layer)

    @property
    def active(self) -> DeviceArray:
        """Over a GpuKVCache: device int32[M], 1 for a slot the step appends to and commits,
        0 for an idle slot (left alone); all 1 at first. Rewrite it between replays (after
        synchronize()). Over a pool: StateError (the step's sequences are begin_step's)."""
        if self._buf.freed:
            raise StateError("use of a destroyed DecodeGraph")
        return self._steps.active

    def out(self, layer: int) -> DeviceArray:
        """The attention output of `layer`: [R, Hq, D] float32."""
        return self._view(3, layer)

    # ------------------------------------------------------------------ the step

    def _launch_step(self, stream) -> None:
        st = self._steps
        for layer in range(self.storage.spec.num_layers):
            q, k, v, out = (self._view(i, layer) for i in range(4))
            if self._rope is not None:
                st.rope(q, k, stream, self._rope)
            st.append(layer, k, v, stream)
            st.attend(q, out, layer, stream)
        st.advance(stream)
    def _capture(self) -> None:
        drv = driver.cuda()
        h = self.stream.handle
        driver.call("cuStreamBeginCapture", h, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
        try:
            self._launch_step(self.stream)
        except BaseException:
            err, graph = drv.cuStreamEndCapture(h)  # leave capture mode; the error that stopped it wins
            if err == drv.CUresult.CUDA_SUCCESS and graph is not None:
                drv.cuGraphDestroy(graph)
            raise
        graph = driver.call("cuStreamEndCapture", h)
        self._graph = driver.owned_handle(self, self.ctx, "cuGraphDestroy", graph)
        exec_ = driver.call("cuGraphInstantiate", graph, 0)
        self._exec = driver.owned_handle(self, self.ctx, "cuGraphExecDestroy", exec_)
        self._exec_handle = exec_

    def _check_live(self, stream) -> None:
        if self._exec is None or not self._exec.alive:
            raise StateError("use of a destroyed DecodeGraph")
        self._steps.check_replay(stream)

    @driver.in_context
    def replay(self, *, stream=None) -> None:
        """Launches the captured step (no sync). StateError when the storage's generation
        changed since capture, the plan was freed, or (over a pool) no step of one position
        per sequence is begun or `stream` is not the pool's."""
        with self._guard("DecodeGraph.replay"), self._steps.guard("DecodeGraph.replay"):
            self._check_live(stream)
            st = self.stream if stream is None else stream
            driver.call("cuGraphLaunch", self._exec_handle, driver.stream_handle(st))
            self._steps.launched_on(st)

    @driver.in_context
    def step_eager(self, *, stream=None) -> None:
        """The same step, launched kernel by kernel (no graph); the same checks as replay."""
        with self._guard("DecodeGraph.step_eager"), self._steps.guard("DecodeGraph.step_eager"):
            self._check_live(stream)
            self._launch_step(self.stream if stream is None else stream)

    def synchronize(self) -> None:
        """Waits for the graph's stream (then write the inputs of the next step)."""
        self.stream.synchronize()

    @driver.in_context
    def destroy(self) -> None:
        """Releases the graph, its buffers, plan and stream (idempotent; also done when the
        DecodeGraph is collected). Over a pool, the pool and its stream stay."""
        with self._guard("DecodeGraph.destroy"):
            for fin in (self._exec, self._graph):
                if fin is not None:
                    fin()
            if self.stream._handle is not None:
                self.stream.synchronize()
                if self._steps.owns_stream:
                    self.stream.destroy()
            self._steps.release()
            self._buf.free()


def _align(n: int) -> int:
    return (n + 255) // 256 * 256
