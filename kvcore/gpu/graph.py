"""DecodeGraph: one decode step of every layer, captured once as a CUDA graph and replayed.

1. Fixed buffers (graph mode means fixed addresses): the graph owns one device allocation
   holding, per layer, q [M, Hq, D] and k, v [M, Hkv, D] in `dtype`, and out [M, Hq, D]
   float32. The caller writes q/k/v of the next token between replays and reads out.
2. The captured step, on the graph's stream, is for each layer
       RoPE on q and k at position lengths[m]  (skipped with rope=False)
       cache.append(layer, k, v)                (writes at lengths[m], on the device)
       attention(q, out, layer, pending=1)      (positions [0, lengths[m] + 1))
   and then cache.advance() once: lengths grow on the device, so replaying the same graph
   step after step needs no host work and no re-capture.
3. `replay()` refuses (StateError) once the cache's `generation` changed or it was freed:
   the graph holds raw addresses. `step_eager()` launches the same sequence without the
   graph (for comparisons and benchmarks).
4. Errors of the append (capacity, non-finite input) land in the cache's per-slot status
   (that slot's step is not committed, the others' are); `cache.check()` turns them into
   exceptions naming the slots at the caller's next synchronisation. `active` (int32[M])
   selects the slots a replay appends to and commits.
"""
from __future__ import annotations

import numpy as np

from .._validate import check_index
from ..errors import DTypeError, StateError
from . import driver, kernels
from .attention import AttentionPlan, apply_rope
from .driver import Stream
from .memory import DeviceArray, DeviceBuffer

_DTYPES = ("float32", "float16", "bfloat16")


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class DecodeGraph:
    """A captured decode step over every layer and slot of `cache`.

    dtype: dtype of the q/k/v buffers ("float32", "float16", "bfloat16"); rope: apply
    RoPE (theta, style, rotary_dim as in apply_rope) before the append; scale and
    max_length: as in AttentionPlan. The graph runs on its own stream unless `stream` is
    given to replay/step_eager.
    """

    def __init__(self, cache, *, dtype: str = "float16", rope: bool = True, theta: float = 10000.0,
                 style: str = "neox", rotary_dim: int | None = None, scale: float | None = None,
                 max_length: int | None = None):
        if dtype not in _DTYPES:
            raise DTypeError(f"invalid dtype: expected float32, float16 or bfloat16, got {dtype!r}")
        self.ctx = cache.ctx
        with self.ctx:
            self._build(cache, dtype, rope, theta, style, rotary_dim, scale, max_length)

    def _build(self, cache, dtype, rope, theta, style, rotary_dim, scale, max_length) -> None:
        driver.refuse_while_capturing("DecodeGraph()", cache.stream)
        s = cache.spec
        self.cache = cache
        self.generation = cache.generation
        self.dtype = _np_dtype(dtype)
        self._rope = dict(theta=theta, style=style, rotary_dim=rotary_dim) if rope else None
        M, L, Hq, Hkv, D = cache.slots, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim
        self.plan = AttentionPlan(cache, q_dtype=dtype, scale=scale, max_length=max_length)
        if rope:
            kernels.function("rope", "kv_rope", cache.ctx)  # load the module before capturing
        isz = self.dtype.itemsize
        q_bytes, kv_bytes, out_bytes = M * Hq * D * isz, M * Hkv * D * isz, M * Hq * D * 4
        self._layer_bytes = _align(q_bytes) + 2 * _align(kv_bytes) + _align(out_bytes)
        self._offsets = (0, _align(q_bytes), _align(q_bytes) + _align(kv_bytes),
                         _align(q_bytes) + 2 * _align(kv_bytes))
        self._buf = DeviceBuffer.zeros(L * self._layer_bytes, ctx=cache.ctx)
        self._active = DeviceBuffer.from_numpy(np.ones(M, np.int32), ctx=cache.ctx)
        self._shapes = ((M, Hq, D), (M, Hkv, D), (M, Hkv, D), (M, Hq, D))
        self.stream = Stream.create(cache.ctx)
        self._graph = self._exec = None  # finalizers (driver.owned_handle) once captured
        self._capture()

    # ------------------------------------------------------------------ buffers

    def _view(self, which: int, layer: int) -> DeviceArray:
        if self._buf.freed:
            raise StateError("use of a destroyed DecodeGraph")
        layer = check_index("layer", layer, self.cache.spec.num_layers)
        dtype = np.float32 if which == 3 else self.dtype
        return self._buf.view(self._shapes[which], dtype,
                              offset=layer * self._layer_bytes + self._offsets[which])

    def q(self, layer: int) -> DeviceArray:
        """The q input of `layer`: [M, Hq, D] of the graph's dtype (rotated in place)."""
        return self._view(0, layer)

    def k(self, layer: int) -> DeviceArray:
        """The k input of `layer`: [M, Hkv, D] (rotated in place, then appended)."""
        return self._view(1, layer)

    def v(self, layer: int) -> DeviceArray:
        return self._view(2, layer)

    @property
    def active(self) -> DeviceArray:
        """Device int32[M]: 1 for a slot the step appends to and commits, 0 for an idle slot
        (left alone); all 1 at first. Rewrite it between replays (after synchronize())."""
        if self._buf.freed:
            raise StateError("use of a destroyed DecodeGraph")
        return self._active.view((self.cache.slots,), np.int32)

    def out(self, layer: int) -> DeviceArray:
        """The attention output of `layer`: [M, Hq, D] float32."""
        return self._view(3, layer)

    # ------------------------------------------------------------------ the step

    def _launch_step(self, stream) -> None:
        c = self.cache
        for layer in range(c.spec.num_layers):
            q, k, v, out = (self._view(i, layer) for i in range(4))
            if self._rope is not None:
                apply_rope(q, c, k=k, stream=stream, **self._rope)
            c.append(layer, k, v, active=self.active, stream=stream)
            self.plan.run(q, out, layer, pending=1, stream=stream)
        c.advance(active=self.active, stream=stream)

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

    def _check_live(self) -> None:
        if self._exec is None or not self._exec.alive:
            raise StateError("use of a destroyed DecodeGraph")
        if self.plan.freed:
            raise StateError("the DecodeGraph's AttentionPlan was freed: its graph would write "
                             "to the freed workspace; capture a new DecodeGraph")
        c = self.cache
        if c.freed or c.generation != self.generation:
            raise StateError(f"the cache changed since the graph was captured (generation "
                             f"{self.generation} -> {c.generation}{', freed' if c.freed else ''}): "
                             f"capture a new DecodeGraph")

    @driver.in_context
    def replay(self, *, stream=None) -> None:
        """Launches the captured step (no sync). StateError when the cache's generation
        changed since capture, or the plan was freed."""
        self._check_live()
        st = self.stream if stream is None else stream
        driver.call("cuGraphLaunch", self._exec_handle, driver.stream_handle(st))
        self.cache.launched_on(st)

    @driver.in_context
    def step_eager(self, *, stream=None) -> None:
        """The same step, launched kernel by kernel (no graph)."""
        self._check_live()
        self._launch_step(self.stream if stream is None else stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    @driver.in_context
    def destroy(self) -> None:
        """Releases the graph, its buffers, plan and stream (idempotent; also done when the
        DecodeGraph is collected)."""
        for fin in (self._exec, self._graph):
            if fin is not None:
                fin()
        if self.stream._handle is not None:
            self.stream.synchronize()
            self.stream.destroy()
        self.plan.free()
        self._buf.free()
        self._active.free()


def _align(n: int) -> int:
    return (n + 255) // 256 * 256
