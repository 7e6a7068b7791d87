"""GpuKVCache: M sequences (slots) of one KVSpec in device memory, graph-safe.

1. Storage (`GpuLayout`, pure arithmetic, CPU-testable): one device allocation of four
   256-byte-aligned regions [K codes][V codes][K scales][V scales]:
       codes  [L][M][Hkv][N][W]  code dtype      (head-major: one head's history is contiguous;
                                                  W = D, or D/2 bytes for q4_0 / q4_1)
       scales [L][M][Hkv][N][S]  scale dtype     (S = 0: the scale regions are empty)
   and one small metadata allocation: per layer the M slot base pointers of K codes, V codes,
   K scales, V scales (uint64 [L][M] each; 0 for formats without scales), the lengths
   int32[M] and the per-slot status int32[M]. Addresses never change while the cache lives.
2. Launch path (graph-capturable, no sync): `append` quantizes on the device at the write
   position read from the device lengths; `advance` commits. Errors set the slot's device
   status (capacity: nothing written to that slot; a refused row: that slot's step not
   committed); the other slots go on. `active` (device int32[M]) leaves slots alone.
3. Sync path (refuses while capturing): `check`/`synchronize`, `length`, `truncate`,
   `reset`, `scatter`, `snapshot`, `restore`; each first waits for the cache's stream and
   for every other stream kvcore launched work of this cache on (append/advance/attention/
   RoPE with stream=, DecodeGraph replays: an event recorded after each); each turns a
   set status into NonFiniteError, FormatError (a value past the format's range, as on
   the CPU) or CapacityError naming the slots, and clears it.
4. `generation` bumps on anything that moves an address (only `free()` here); graphs
   compare it before replay.
"""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, cast

import numpy as np

from .._quant import input_limit
from .._storage import REGIONS   # k_codes, v_codes, k_scales, v_scales: the allocation order
from .._validate import check_index, float_input_dtypes
from ..errors import (CapacityError, DTypeError, FormatError, NonFiniteError, ShapeError,
                      SnapshotError, SpecError, StateError)
from ..formats import Format, describe
from ..quant import dequantize
from ..snapshot import Snapshot, fit_snapshot
from ..spec import KVSpec
from . import driver, kernels
from .driver import Context, Stream
from .memory import DeviceArray, DeviceBuffer, as_device_array

ALIGN = 256
ERR_CAPACITY, ERR_NONFINITE, ERR_RANGE = 1, 2, 4  # bits of a slot's device status (cuda/common.cuh)
_REASONS = ((ERR_NONFINITE, "non-finite input (NaN or inf)"), (ERR_RANGE, "a value out of range of format {fmt}"),
            (ERR_CAPACITY, "capacity {cap} reached"))
_APPEND_WARPS = 8                   # warps per block of kv_append (one warp per head row)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


GPU_FORMATS = ("f32", "f16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "q8_0", "q4_0", "q4_1")
"""The formats the GPU kernels hold for K and V (every one of kvcore.formats.ROW_FORMATS)."""
GPU_PAIRS = ("q8_0/q4_0", "f16/q4_0")
"""The K/V pairs of two formats the GPU kernels hold (KVSpec(k_format=, v_format=))."""
GPU_GROUPED_PAIRS = ("q4_1ch/q4_1", "q4_1ch/q4_0")
"""The K/V pairs of K q4_1ch (KIVI's layout: by channel over groups of 32 positions, with a
float16 residual per sequence; a GpuKVPool's page_size a multiple of 32)."""


def check_gpu_format(spec: KVSpec, what: str) -> None:
    """FormatError unless the GPU kernels have spec's format: every format that stores K
    and V (kvcore.formats.ROW_FORMATS) for both, and the K/V pairs of GPU_PAIRS and
    GPU_GROUPED_PAIRS."""
    pairs = GPU_PAIRS + GPU_GROUPED_PAIRS
    if spec.paired and spec.format not in pairs:
        raise FormatError(f"{what}: K format {spec.k_format} and V format {spec.v_format}: the "
                          f"GPU kernels hold one format for both or the K/V pairs "
                          f"{', '.join(pairs)} (KVCache and KVPool on the CPU hold every pair)")


def no_residual(spec: KVSpec) -> FormatError:
    """The error of asking a cache or pool whose K format has no residual for one."""
    return FormatError(f"K format {spec.k_format} has no residual (only q4_1ch, by channel over "
                       f"groups of positions, has one)")


def region_format(spec: KVSpec, region: str) -> Format:
    """The format of a region: K's for k_codes / k_scales, V's for v_codes / v_scales."""
    return spec.k_fmt if region.startswith("k") else spec.v_fmt


@dataclass(frozen=True)
class GpuLayout:
    """Byte layout of a GpuKVCache of `slots` slots. Offsets are from the allocation's
    base; `strides(region)` are byte strides of codes [L, M, Hkv, N, W] / scales
    [L, M, Hkv, N, S] (W = fmt.code_width(D): D, or D/2 for the 4-bit formats; each side
    in its own format). FormatError for a K/V pair the GPU has no kernels for."""

    spec: KVSpec
    slots: int

    def __post_init__(self) -> None:
        check_gpu_format(self.spec, "GpuLayout")

    def shape(self, region: str) -> tuple[int, ...]:
        """[L, M, Hkv, N, W] of a codes region, [L, M, Hkv, N, S] of a scales region."""
        return self._regions[region][0]

    def itemsize(self, region: str) -> int:
        """Bytes of one element of a region (0: a scales region of a float format)."""
        return self._regions[region][1]

    def strides(self, region: str) -> tuple[int, ...]:
        return self._regions[region][2]

    def region_bytes(self, region: str) -> int:
        return self._regions[region][3]

    @cached_property
    def _regions(self) -> dict[str, tuple[tuple[int, ...], int, tuple[int, ...], int]]:
        """(shape, itemsize, strides, bytes) of each region, computed once: the launch
        path reads them on every call."""
        s, out = self.spec, {}
        for region in REGIONS:
            f = region_format(s, region)
            if region.endswith("codes"):
                width, itemsize = f.code_width(s.head_dim), f.code_bytes
            else:
                width, itemsize = f.scales_per_row(s.head_dim), f.scale_dtype.itemsize if f.quantized else 0
            shape = (s.num_layers, self.slots, s.num_kv_heads, s.capacity, width)
            out[region] = (shape, itemsize, _strides(shape, itemsize), math.prod(shape) * itemsize)
        return out

    @cached_property
    def offsets(self) -> dict[str, int]:
        """Byte offsets of the regions k_codes, v_codes, k_scales, v_scales, and of
        k_residual (K q4_1ch's open groups, float16 [L][M][Hkv][32][D]; empty otherwise)."""
        out, off = {}, 0
        for region in REGIONS:
            out[region] = off
            off += _align(self.region_bytes(region))
        out["k_residual"] = off
        return out

    @cached_property
    def residual_shape(self) -> tuple[int, ...] | None:
        """[L, M, Hkv, 32, D] of K q4_1ch's residual (float16: slot p mod 32 holds
        position p of the open group), None for every other K format."""
        s, g = self.spec, self.spec.k_fmt.group
        return (s.num_layers, self.slots, s.num_kv_heads, g, s.head_dim) if g else None

    @property
    def residual_bytes(self) -> int:
        return 0 if self.residual_shape is None else 2 * math.prod(self.residual_shape)

    def residual_offset(self, layer: int, slot: int) -> int:
        """Byte offset of (layer, slot)'s residual [Hkv][32][D] (K q4_1ch)."""
        _, M, H, G, D = cast(tuple, self.residual_shape)
        return self.offsets["k_residual"] + (layer * M + slot) * H * G * D * 2

    @property
    def data_bytes(self) -> int:
        return self.offsets["k_residual"] + _align(self.residual_bytes)

    # metadata: [k_codes ptrs][v_codes ptrs][k_scales ptrs][v_scales ptrs] uint64 [L][M],
    # then lengths int32[M], then the status int32[M] (error bits per slot)
    @cached_property
    def meta_offsets(self) -> dict[str, int]:
        table = self.spec.num_layers * self.slots * 8
        return {"k_codes": 0, "v_codes": table, "k_scales": 2 * table, "v_scales": 3 * table,
                "lengths": 4 * table, "status": 4 * table + 4 * self.slots}

    @property
    def meta_bytes(self) -> int:
        return self.meta_offsets["status"] + 4 * self.slots

    @property
    def total_bytes(self) -> int:
        """Device bytes the cache allocates (data plus metadata)."""
        return self.data_bytes + self.meta_bytes

    def slot_offset(self, region: str, layer: int, slot: int) -> int:
        """Byte offset of (layer, slot)'s [Hkv][N][W] codes / [Hkv][N][S] scales."""
        strides = self.strides(region)
        return self.offsets[region] + layer * strides[0] + slot * strides[1]


def _strides(shape, itemsize) -> tuple[int, ...]:
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def max_slots_for_memory(spec: KVSpec, free_bytes: int, reserve_bytes: int = 0) -> int:
    """The most slots whose GpuKVCache (data and metadata, exact bytes) fits in
    `free_bytes - reserve_bytes`; 0 when not even one fits."""
    for name, v in (("free_bytes", free_bytes), ("reserve_bytes", reserve_bytes)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise SpecError(f"{name} must be a non-negative int, got {v!r}")
    budget = int(free_bytes) - int(reserve_bytes)
    one = GpuLayout(spec, 1).total_bytes
    if budget < one:
        return 0
    per_slot = GpuLayout(spec, 2).total_bytes - one  # without alignment padding
    m = max(1, budget // per_slot)
    while m > 1 and GpuLayout(spec, m).total_bytes > budget:
        m -= 1
    return m


class GpuKVCache(driver.DeviceOwner):
    """M slots (sequences) of `spec` in device memory; see the module docstring.

    Device views (DeviceArray; DLPack / __cuda_array_interface__):
      keys(layer), values(layer)             [M, Hkv, N, W] code dtype (W = D, or D/2 for q4_0 / q4_1)
      key_scales(layer), value_scales(layer) [M, Hkv, N, S] scale dtype
      k_ptrs(layer), v_ptrs(layer), k_scale_ptrs(layer), v_scale_ptrs(layer)  uint64[M]
      lengths                                int32[M];  status  int32[M] (error bits per slot)

    Not copyable nor picklable (DeviceCopyError): move a slot with snapshot() and restore().
    """

    _holds = "device memory (its K/V codes, scales and metadata) and a stream"
    _move = ("move the content instead: cache.snapshot(slot) gives a host Snapshot (which "
             "pickles, or snapshot.save(path)), and other.restore(snapshot, slot) writes it "
             "into another GpuKVCache")

    def __init__(self, spec: KVSpec, slots: int = 1, *, device: int = 0, stream=None):
        if not isinstance(spec, KVSpec):
            raise DTypeError(f"invalid type of spec: expected KVSpec, got {type(spec).__name__}")
        check_gpu_format(spec, "GpuKVCache")
        if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots <= 0:
            raise SpecError(f"slots must be a positive int, got {slots!r}")
        self.spec = spec
        self.slots = int(slots)
        self.layout = GpuLayout(spec, self.slots)
        self.ctx = Context.get(device)
        with self.ctx:
            self._create(stream)

    def _create(self, stream) -> None:
        # kernels first: a driver that cannot load them leaves nothing behind
        self._fn_append = kernels.function("kv_append", "kv_append", self.ctx)
        self._fn_advance = kernels.function("kv_append", "kv_advance", self.ctx)
        driver.refuse_while_capturing("GpuKVCache()", *(() if stream is None else (stream,)))
        free, _ = self.ctx.mem_get_info()
        if self.layout.total_bytes > free:
            fit = max_slots_for_memory(self.spec, free)
            raise SpecError(f"GpuKVCache of {self.slots} slots needs {self.layout.total_bytes} bytes, "
                            f"the device has {free} free: at most {fit} slots fit")
        # the largest pitch of a 2D/3D copy (CU_DEVICE_ATTRIBUTE_MAX_PITCH): _copy3d stays within it
        self._max_pitch = self.ctx.attribute(driver.cuda().CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH)
        self._own_stream = stream is None
        self.stream = Stream.create(self.ctx) if stream is None else (
            stream if isinstance(stream, Stream) else Stream.from_handle(int(driver.stream_handle(stream)), self.ctx))
        self.generation = 0
        self._pending: dict[int, driver.Event] = {}  # other streams launched on -> event after it
        self._data = DeviceBuffer.alloc(self.layout.data_bytes, ctx=self.ctx)
        self._meta = DeviceBuffer.alloc(self.layout.meta_bytes, ctx=self.ctx)
        self._meta.copy_from_host(self._host_meta())

    @classmethod
    def fit(cls, spec: KVSpec, reserve_bytes: int = 0, *, device: int = 0, stream=None) -> "GpuKVCache":
        """The cache with the most slots that fit in the device's free memory minus
        `reserve_bytes`; SpecError with the numbers when not one slot fits."""
        check_gpu_format(spec, "GpuKVCache")
        ctx = Context.get(device)
        free, _ = ctx.mem_get_info()
        m = max_slots_for_memory(spec, free, reserve_bytes)
        if m == 0:
            raise SpecError(f"one slot needs {GpuLayout(spec, 1).total_bytes} bytes, the device "
                            f"has {free} free minus reserve {reserve_bytes}")
        return cls(spec, m, device=device, stream=stream)

    # ------------------------------------------------------------------ addresses

    def _host_meta(self) -> np.ndarray:
        lay, L, M = self.layout, self.spec.num_layers, self.slots
        out = np.zeros(lay.meta_bytes, np.uint8)
        base = self._data.ptr
        for region in REGIONS:
            if not lay.itemsize(region):
                continue
            strides = lay.strides(region)
            ptrs = (np.uint64(base + lay.offsets[region])
                    + np.arange(L, dtype=np.uint64)[:, None] * np.uint64(strides[0])
                    + np.arange(M, dtype=np.uint64)[None, :] * np.uint64(strides[1]))
            off = lay.meta_offsets[region]
            out[off:off + ptrs.nbytes] = ptrs.view(np.uint8).ravel()
        return out

    def _alive(self) -> None:
        if self._data.freed:
            raise StateError("use of a freed GpuKVCache")

    def _ptr(self, region: str, layer, slot) -> int:
        self._alive()
        layer = check_index("layer", layer, self.spec.num_layers)
        slot = check_index("slot", slot, self.slots)
        self._check_scales(region)
        return self._data.ptr + self.layout.slot_offset(region, layer, slot)

    def _check_scales(self, region: str) -> None:
        """FormatError for the scales of a side whose format has none."""
        if not self.layout.itemsize(region):
            raise FormatError(f"format {region_format(self.spec, region).name} has no scales"
                              + (f" ({region[0].upper()} of {self.spec.format})" if self.spec.paired else ""))

    def k_ptr(self, layer: int, slot: int) -> int:
        """Address of K codes [Hkv][N][D] of (layer, slot)."""
        return self._ptr("k_codes", layer, slot)

    def v_ptr(self, layer: int, slot: int) -> int:
        return self._ptr("v_codes", layer, slot)

    def k_scale_ptr(self, layer: int, slot: int) -> int:
        """Address of K scales [Hkv][N][S] of (layer, slot); FormatError without scales."""
        return self._ptr("k_scales", layer, slot)

    def v_scale_ptr(self, layer: int, slot: int) -> int:
        return self._ptr("v_scales", layer, slot)

    def _ptr_table(self, region: str, layer) -> DeviceArray:
        self._alive()
        layer = check_index("layer", layer, self.spec.num_layers)
        off = self.layout.meta_offsets[region] + layer * self.slots * 8
        return self._meta.view((self.slots,), np.uint64, offset=off, producer=self)

    def k_ptrs(self, layer: int) -> DeviceArray:
        """Device uint64[M]: the K code base pointer of every slot of `layer`."""
        return self._ptr_table("k_codes", layer)

    def v_ptrs(self, layer: int) -> DeviceArray:
        return self._ptr_table("v_codes", layer)

    def k_scale_ptrs(self, layer: int) -> DeviceArray:
        """Device uint64[M] of K scale base pointers (all 0 for formats without scales)."""
        return self._ptr_table("k_scales", layer)

    def v_scale_ptrs(self, layer: int) -> DeviceArray:
        return self._ptr_table("v_scales", layer)

    @property
    def lengths(self) -> DeviceArray:
        """Device int32[M]: committed positions of every slot (what graphs read)."""
        self._alive()
        return self._meta.view((self.slots,), np.int32, offset=self.layout.meta_offsets["lengths"],
                               producer=self)

    @property
    def status(self) -> DeviceArray:
        """Device int32[M]: per slot, bit 1 capacity, bit 2 non-finite input, bit 4 out of
        the format's range; a slot with a bit set is not committed; cleared by check()."""
        self._alive()
        return self._meta.view((self.slots,), np.int32, offset=self.layout.meta_offsets["status"],
                               producer=self)

    def _region_view(self, region: str, layer) -> DeviceArray:
        self._alive()
        layer = check_index("layer", layer, self.spec.num_layers)
        f, lay = region_format(self.spec, region), self.layout
        self._check_scales(region)
        dtype = f.code_dtype if region.endswith("codes") else f.scale_dtype
        return self._data.view(lay.shape(region)[1:], dtype,
                               offset=lay.offsets[region] + layer * lay.strides(region)[0], producer=self)

    def keys(self, layer: int) -> DeviceArray:
        """K codes of `layer`, every slot, full capacity: [M, Hkv, N, W] code dtype."""
        return self._region_view("k_codes", layer)

    def values(self, layer: int) -> DeviceArray:
        return self._region_view("v_codes", layer)

    def key_scales(self, layer: int) -> DeviceArray:
        """K scales of `layer`: [M, Hkv, N, S] scale dtype; FormatError without scales."""
        return self._region_view("k_scales", layer)

    def value_scales(self, layer: int) -> DeviceArray:
        return self._region_view("v_scales", layer)

    def residual_ptr(self, layer: int) -> int:
        """Address of `layer`'s K q4_1ch residual [M][Hkv][32][D] float16; 0 for every
        other K format."""
        self._alive()
        layer = check_index("layer", layer, self.spec.num_layers)
        return self._data.ptr + self.layout.residual_offset(layer, 0) if self.layout.residual_shape else 0

    def key_residual(self, layer: int) -> DeviceArray:
        """K q4_1ch's residual of `layer`: float16 [M, Hkv, 32, D], slot p mod 32 holding
        position p of each slot's open group; FormatError for every other K format."""
        if not self.layout.residual_shape:
            raise no_residual(self.spec)
        return self._data.view(self.layout.residual_shape[1:], np.float16,
                               offset=self.residual_ptr(layer) - self._data.ptr, producer=self)

    @property
    def memory_bytes(self) -> int:
        """Exact device bytes allocated (data and metadata)."""
        return self.layout.total_bytes

    # ------------------------------------------------------------------ launch path

    @driver.in_context
    def append(self, layer: int, k, v, *, slot: int | None = None, active=None, stream=None) -> None:
        """Quantizes k and v into `layer` at each slot's current length (no sync; capturable).

        k, v: device arrays (DeviceArray, CuPy, torch, anything with
        __cuda_array_interface__ or DLPack), float32, float16 or bfloat16, the same shape
        and dtype, last axis contiguous, other strides free:
          slot None: [M, Hkv, D], one position for every slot;
          slot s:    [T, Hkv, D], T positions for slot s.
        active (slot None only): a device int32[M], 0 for a slot to leave alone (neither
        written nor committed by advance(active=)); None: every slot. Graphs replay with
        another set by rewriting it. Runs on `stream` (default: the cache's). A slot past
        capacity gets nothing written and its status bit set; a non-finite or out-of-range
        row sets its slot's bit too; that slot's step will not commit, the others' will.
        """
        self._alive()
        s = self.spec
        layer = check_index("layer", layer, s.num_layers)
        if slot is not None:
            slot = check_index("slot", slot, self.slots)
        st = self.stream if stream is None else stream
        k = as_device_array(k, "k", stream=st, ctx=self.ctx)
        v = as_device_array(v, "v", stream=st, ctx=self.ctx)
        rows = self.slots if slot is None else "T"
        expected = [rows, s.num_kv_heads, s.head_dim]
        for name, x in (("k", k), ("v", v)):
            _check_input(name, x, expected)
        if v.shape != k.shape or v.dtype != k.dtype or v.strides != k.strides:
            raise ShapeError(f"invalid v: expected the shape, dtype and strides of k "
                             f"({list(k.shape)} {k.dtype}), got {list(v.shape)} {v.dtype}")
        T = k.shape[0]
        if slot is not None and not 1 <= T <= s.capacity:
            raise ShapeError(f"invalid shape of k: expected [T, {s.num_kv_heads}, {s.head_dim}] "
                             f"with 1 <= T <= {s.capacity}, got {list(k.shape)}")
        in_dtype = kernels.INPUT_DTYPES[k.dtype.name]
        isz = k.dtype.itemsize
        lay, base, meta = self.layout, self._data.ptr, self._meta.ptr
        heads = k.shape[0] * s.num_kv_heads * 2
        grid = ((heads + _APPEND_WARPS - 1) // _APPEND_WARPS, 1, 1)
        args = [
            (k.ptr, None), (v.ptr, None), (in_dtype, ctypes.c_int),
            (k.strides[0] // isz, ctypes.c_longlong), (k.strides[1] // isz, ctypes.c_longlong),
            (base + lay.slot_offset("k_codes", layer, 0), None),
            (base + lay.slot_offset("v_codes", layer, 0), None),
            (base + lay.slot_offset("k_scales", layer, 0) if s.k_fmt.quantized else 0, None),
            (base + lay.slot_offset("v_scales", layer, 0) if s.v_fmt.quantized else 0, None),
            (self.residual_ptr(layer), None),
            (meta + lay.meta_offsets["lengths"], None), (meta + lay.meta_offsets["status"], None),
            (self._active_ptr(active, slot), None),
            (s.k_fmt.id, ctypes.c_int), (s.v_fmt.id, ctypes.c_int), (self.slots, ctypes.c_int),
            (s.num_kv_heads, ctypes.c_int),
            (s.capacity, ctypes.c_int), (s.head_dim, ctypes.c_int),
            (-1 if slot is None else slot, ctypes.c_int), (T, ctypes.c_int)]
        # K q4_1ch, T rows of one slot: check every row first (mode 1), then write (mode 2),
        # so that a refused step leaves the residual as it was (cuda/kv_append.cu)
        for mode in (1, 2) if s.k_fmt.group and slot is not None else (0,):
            driver.launch(self._fn_append, grid, (32 * _APPEND_WARPS, 1, 1),
                          args + [(mode, ctypes.c_int)], stream=st)
        self.launched_on(st)

    @driver.in_context
    def advance(self, *, slot: int | None = None, steps: int = 1, active=None, stream=None) -> None:
        """Commits a step (no sync; capturable): slot None: every (active) slot's length
        += 1; slot s: length[s] += steps. A slot whose status is set is not committed; one
        that would pass capacity neither (its capacity bit is set); the others are."""
        self._alive()
        if slot is None:
            if steps != 1:
                raise ShapeError(f"invalid steps: advance of every slot commits 1, got {steps}")
        else:
            slot = check_index("slot", slot, self.slots)
            if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps <= self.spec.capacity:
                raise ShapeError(f"invalid steps: expected 1 <= steps <= {self.spec.capacity}, got {steps!r}")
        meta, off = self._meta.ptr, self.layout.meta_offsets
        driver.launch(self._fn_advance, (1, 1, 1), (min(1024, _round32(self.slots)), 1, 1), [
            (meta + off["lengths"], None), (meta + off["status"], None),
            (self._active_ptr(active, slot), None), (self.slots, ctypes.c_int), (self.spec.capacity, ctypes.c_int),
            (-1 if slot is None else slot, ctypes.c_int), (int(steps), ctypes.c_int),
        ], stream=self.stream if stream is None else stream)
        self.launched_on(stream)

    def _active_ptr(self, active, slot) -> int:
        """The device address of `active` (int32[M] on the cache's device), or 0 for None."""
        if active is None:
            return 0
        if slot is not None:
            raise ShapeError("invalid active: it selects slots of a step of every slot (slot=None)")
        a = as_device_array(active, "active", ctx=self.ctx)
        if a.shape != (self.slots,) or a.dtype != np.int32 or not a.is_c_contiguous:
            raise ShapeError(f"invalid active: expected a contiguous int32 [{self.slots}], got "
                             f"{a.dtype} {list(a.shape)}")
        return a.ptr

    def launched_on(self, stream) -> None:
        """Notes that work on this cache was queued on `stream` (None: the cache's own), so
        that the synchronous calls wait for it too: an event is recorded there after the
        work (not while the stream captures: a replay of the graph is noted instead)."""
        if stream is None:
            return
        h = int(driver.stream_handle(stream))
        if h == self.stream.ptr or driver.is_capturing(stream):
            return
        ev = self._pending.get(h)
        if ev is None:
            ev = self._pending[h] = driver.Event.create(self.ctx, timing=False)
        ev.record(stream=stream)

    @driver.in_context
    def order_consumer(self, consumer) -> None:
        """Makes stream `consumer` (a Stream or handle; 1 = legacy, 2 = per-thread) wait
        for the work queued so far on this cache: its stream and the others kvcore
        launched on (the exports' `__dlpack__(stream=)` calls it)."""
        c = driver.stream_handle(consumer)
        if int(c) != self.stream.ptr:
            driver.order_after(self.stream.ptr, consumer, self.ctx, "the cache's work")
        for ev in self._pending.values():
            driver.call("cuStreamWaitEvent", c, ev.handle, 0)

    def _wait_pending(self) -> None:
        """The host waits for the work noted by launched_on on other streams."""
        for ev in self._pending.values():
            ev.synchronize()

    # ------------------------------------------------------------------ sync path

    @driver.in_context
    def _sync(self, what: str) -> None:
        self._alive()
        driver.refuse_while_capturing(f"GpuKVCache.{what}", self.stream)
        self._wait_pending()
        self.stream.synchronize()
        off = self.layout.meta_offsets["status"]
        status = self._meta.copy_to_host(np.zeros(self.slots, np.int32), offset=off)
        bad = np.flatnonzero(status)
        if not bad.size:
            return
        self._meta.copy_from_host(np.zeros(self.slots, np.int32), offset=off)
        names = {"fmt": describe(self.spec.format), "cap": self.spec.capacity}
        why = "; ".join(f"slot {int(m)}: " + ", ".join(text.format(**names) for bit, text in _REASONS
                                                       if status[m] & bit)
                        for m in bad[:16]) + ("; ..." if bad.size > 16 else "")
        every = int(np.bitwise_or.reduce(status))
        detail = (f"GPU append/advance refused {bad.size} slot(s) ({why}); their step was not "
                  f"committed, the other slots' was")
        if every & ERR_NONFINITE:
            raise NonFiniteError(detail)
        if every & ERR_RANGE:
            raise FormatError(f"{detail} ({range_limits(self.spec)})")
        raise CapacityError(f"{detail}: a step would pass capacity {self.spec.capacity}")

    def check(self) -> None:
        """Synchronises the cache's stream(s); raises NonFiniteError / FormatError /
        CapacityError naming the slot(s) and why (and clears their status) when a launch
        since the last check refused a slot."""
        self._sync("check")

    synchronize = check

    @driver.in_context
    def lengths_host(self) -> np.ndarray:
        """A host copy of the lengths, int32[M] (synchronises)."""
        self._sync("lengths_host")
        out = np.empty(self.slots, np.int32)
        return self._meta.copy_to_host(out, offset=self.layout.meta_offsets["lengths"])

    def length(self, slot: int) -> int:
        """Committed positions of `slot` (synchronises)."""
        slot = check_index("slot", slot, self.slots)
        return int(self.lengths_host()[slot])

    def _set_length(self, slot: int, n: int) -> None:
        self._meta.copy_from_host(np.array([n], np.int32),
                                  offset=self.layout.meta_offsets["lengths"] + 4 * slot)

    @driver.in_context
    def truncate(self, slot: int, n: int) -> None:
        """Rolls `slot` back to its first n positions (0 <= n <= length)."""
        cur = self.length(slot)
        n = check_index("n", n, cur + 1)
        G = self.spec.k_fmt.group
        if G and n % G and n - n % G + G <= cur:   # into a complete group: decode it (K q4_1ch)
            start = n - n % G
            codes, scales = self._group_host(slot, start)
            res = dequantize(codes, scales, self.spec.k_fmt).astype(np.float16)  # [L][Hkv][G][D]
            for layer in range(self.spec.num_layers):
                self._data.copy_from_host(res[layer], offset=self.layout.residual_offset(layer, slot))
        self._set_length(slot, n)

    def _group_host(self, slot: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """K codes uint8 [L][Hkv][G][W] and scales float16 [L][Hkv][G][S] of the group of
        `slot` starting at position `start` (K q4_1ch), copied to the host."""
        s, f = self.spec, self.spec.k_fmt
        out = []
        for region in ("k_codes", "k_scales"):
            width = f.code_width(s.head_dim) if region == "k_codes" else f.scales_per_row(s.head_dim)
            host = np.empty((s.num_layers, s.num_kv_heads, f.group, width),
                            f.code_dtype if region == "k_codes" else f.scale_dtype)
            self._copy3d(region, slot, range(s.num_layers), f.group, host=host, to_host=True, first=start)
            out.append(host)
        self.stream.synchronize()
        return out[0], out[1]

    @driver.in_context
    def reset(self, slot: int | None = None) -> None:
        """Empties `slot` (every slot when None); codes are left, lengths become 0."""
        if slot is None:
            self._sync("reset")
            self._meta.copy_from_host(np.zeros(self.slots, np.int32),
                                      offset=self.layout.meta_offsets["lengths"])
        else:
            self.truncate(slot, 0)

    def _copy3d(self, region: str, slot: int, layers: range, n: int, *,
                host: np.ndarray | None = None, src: "GpuKVCache | None" = None,
                to_host: bool = False, first: int = 0) -> None:
        """Copies positions [first, first + n) of `layers` of (region, slot): with the host
        array [len(layers)][Hkv][n][row] (either way), or from slot 0 of src (first 0).
        One cuMemcpy3DAsync when every pitch is within the device's largest (plan_copy3d)."""
        drv = driver.cuda()
        f, s = region_format(self.spec, region), self.spec
        row = f.code_row_bytes(s.head_dim) if region.endswith("codes") else f.scale_row_bytes(s.head_dim)
        heads = s.num_kv_heads
        dev = CopySide(True, self._data.ptr + self.layout.slot_offset(region, layers.start, slot)
                       + first * row, s.capacity, self.slots * heads)
        if src is not None:
            a = CopySide(True, src._data.ptr + src.layout.slot_offset(region, layers.start, 0),
                         src.spec.capacity, src.slots * heads)
            b = dev
        else:
            h = CopySide(False, host.ctypes.data, n, heads)
            a, b = (dev, h) if to_host else (h, dev)
        for c in plan_copy3d(row, heads, n, len(layers), a, b, self._max_pitch):
            p = drv.CUDA_MEMCPY3D()
            for name, (is_dev, address, pitch, height) in (("src", c.src), ("dst", c.dst)):
                if is_dev:
                    setattr(p, name + "MemoryType", drv.CUmemorytype.CU_MEMORYTYPE_DEVICE)
                    setattr(p, name + "Device", drv.CUdeviceptr(address))
                else:
                    setattr(p, name + "MemoryType", drv.CUmemorytype.CU_MEMORYTYPE_HOST)
                    setattr(p, name + "Host", address)
                setattr(p, name + "Pitch", pitch)
                setattr(p, name + "Height", height)
            p.WidthInBytes, p.Height, p.Depth = c.width, c.height, c.depth
            driver.call("cuMemcpy3DAsync", p, self.stream.handle)

    @driver.in_context
    def snapshot(self, slot: int) -> Snapshot:
        """Positions [0, length) of `slot`, all layers, as the token-major Snapshot the CPU
        cache gives (k_codes [L, n, Hkv, W], scales [L, n, Hkv, S])."""
        n = self.length(slot)
        s = self.spec
        L, H = s.num_layers, s.num_kv_heads
        parts = {}
        for region in REGIONS:
            f = region_format(s, region)
            if region.endswith("scales") and not f.quantized:
                parts[region] = None
                continue
            codes = region.endswith("codes")
            width = f.code_width(s.head_dim) if codes else f.scales_per_row(s.head_dim)
            dtype = f.code_dtype if codes else f.scale_dtype
            host = np.empty((L, H, n, width), dtype)
            if n:
                self._copy3d(region, slot, range(L), n, host=host, to_host=True)
            parts[region] = host
        res = self._residual_host(slot) if s.k_fmt.group else None
        self.stream.synchronize()
        parts = {k: None if a is None else np.ascontiguousarray(a.transpose(0, 2, 1, 3))
                 for k, a in parts.items()}
        if res is None:
            return Snapshot(s, n, parts["k_codes"], parts["v_codes"], parts["k_scales"], parts["v_scales"])
        full = n - n % s.k_fmt.group               # the open group: rows without codes yet
        parts["k_codes"][:, full:] = 0
        parts["k_scales"][:, full:] = 0
        return Snapshot(s, n, parts["k_codes"], parts["v_codes"], parts["k_scales"], parts["v_scales"],
                        k_residual=np.ascontiguousarray(res[:, :, :n - full].transpose(0, 2, 1, 3)))

    def _residual_host(self, slot: int) -> np.ndarray:
        """K q4_1ch's residual of `slot`, every layer: float16 [L][Hkv][32][D] (queued on
        the stream: synchronise before reading)."""
        shape = cast(tuple, self.layout.residual_shape)
        out = np.empty((shape[0],) + shape[2:], np.float16)
        for layer in range(shape[0]):
            self._data.copy_to_host(out[layer], offset=self.layout.residual_offset(layer, slot),
                                    stream=self.stream)
        return out

    def _check_source(self, src_spec: KVSpec, n: int, what: str) -> None:
        a, b = self.spec, src_spec
        if (a.num_layers, a.num_kv_heads, a.head_dim, a.format) != (
                b.num_layers, b.num_kv_heads, b.head_dim, b.format):
            raise SnapshotError(
                f"{what} does not fit: expected num_layers={a.num_layers}, num_kv_heads="
                f"{a.num_kv_heads}, head_dim={a.head_dim}, format={a.format}, got "
                f"{b.num_layers}, {b.num_kv_heads}, {b.head_dim}, {b.format}")
        if n > a.capacity:
            raise CapacityError(f"{what} holds {n} positions, the cache's capacity is {a.capacity}")

    def restore(self, snapshot: Snapshot, slot: int, *, requantize: bool = False) -> None:
        """Makes `slot` hold `snapshot` (all layers); its length becomes snapshot.length.
        Checked by kvcore.snapshot.fit_snapshot, as the CPU cache's restore."""
        self.scatter(snapshot, slot, requantize=requantize)

    @driver.in_context
    def scatter(self, src, slot: int, layer: int | None = None, *,
                requantize: bool = False) -> None:
        """Copies positions [0, n) of `src` into `slot`: every layer, or only `layer`.
        src: a Snapshot (from a CPU or GPU cache; checked by fit_snapshot, re-encoded when
        requantize=True) or a one-slot GpuKVCache of the same layers, heads, head_dim and
        format. The slot's length becomes n; when copying one layer, copy the others too
        before reading the slot."""
        self._alive()
        slot = check_index("slot", slot, self.slots)
        s = self.spec
        layers = range(s.num_layers) if layer is None else range(
            check_index("layer", layer, s.num_layers), layer + 1)
        if isinstance(src, GpuKVCache):
            if src.slots != 1:
                raise ShapeError(f"invalid src: expected a one-slot GpuKVCache, got {src.slots} slots")
            if src is self or src.ctx is not self.ctx:
                raise ShapeError("invalid src: expected another cache on the same device")
            n = src.length(0)
            self._check_source(src.spec, n, "source cache")
            self._sync("scatter")
            src.stream.synchronize()
            if n:
                for region in (r for r in REGIONS if self.layout.itemsize(r)):
                    self._copy3d(region, slot, layers, n, src=src)
            if self.layout.residual_shape:
                nbytes = self.layout.residual_offset(0, 1) - self.layout.residual_offset(0, 0)
                for layer in layers:
                    ptr = driver.cuda().CUdeviceptr
                    driver.call("cuMemcpyDtoDAsync", ptr(self._data.ptr + self.layout.residual_offset(layer, slot)),
                                ptr(src._data.ptr + src.layout.residual_offset(layer, 0)), nbytes,
                                self.stream.handle)
        elif isinstance(src, Snapshot):
            src = fit_snapshot(s, src, requantize=requantize)
            n = src.length
            self._sync("scatter")
            hosts = []  # kept alive until the stream has copied them
            for region in REGIONS:
                arr = getattr(src, region)
                if arr is None or not n:
                    continue
                host = np.ascontiguousarray(arr[layers.start:layers.stop].transpose(0, 2, 1, 3))
                hosts.append(host)
                self._copy3d(region, slot, layers, n, host=host)
            if self.layout.residual_shape:            # the open group (K q4_1ch)
                res = np.zeros(self.layout.residual_shape[:1] + self.layout.residual_shape[2:], np.float16)
                open_ = cast(np.ndarray, src.k_residual)
                res[:, :, :open_.shape[1]] = open_.transpose(0, 2, 1, 3)
                hosts.append(res)
                for layer in layers:
                    self._data.copy_from_host(res[layer], offset=self.layout.residual_offset(layer, slot),
                                              stream=self.stream)
        else:
            raise DTypeError(f"invalid type of src: expected Snapshot or GpuKVCache, got {type(src).__name__}")
        self.stream.synchronize()
        self._set_length(slot, n)

    # ------------------------------------------------------------------ lifetime

    @property
    def freed(self) -> bool:
        return self._data.freed

    @driver.in_context
    def free(self) -> None:
        """Releases the device memory (and the cache's own stream); bumps `generation`.
        A second call does nothing; any other use afterwards raises StateError."""
        if self._data.freed:
            return
        driver.refuse_while_capturing("GpuKVCache.free", self.stream)
        self._wait_pending()
        self.stream.synchronize()
        for ev in self._pending.values():
            ev.destroy()
        self._pending.clear()
        self._meta.free()
        self._data.free()
        if self._own_stream:
            self.stream.destroy()
        self.generation += 1

    def __repr__(self):
        s = self.spec
        state = "freed" if self.freed else f"{self.memory_bytes} bytes"
        return (f"GpuKVCache(L={s.num_layers}, M={self.slots}, Hkv={s.num_kv_heads}, "
                f"N={s.capacity}, D={s.head_dim}, format={s.format}, {state})")


MAX_PITCH = 2**31 - 1   # CU_DEVICE_ATTRIBUTE_MAX_PITCH of every device kvcore runs on (sm_80+)


class CopySide(NamedTuple):
    """One side of a head-major copy (GpuKVCache._copy3d): device memory or a host array,
    `address` of head 0 of the first layer copied; heads of `head_rows` rows (the
    capacity, or n for the host's [L][Hkv][n][row]) and layers of `layer_heads` heads (the
    slots times Hkv, or Hkv for the host)."""
    device: bool
    address: int
    head_rows: int
    layer_heads: int


class Copy3D(NamedTuple):
    """One cuMemcpy3D: src and dst as (device, address, pitch, height), the box."""
    src: tuple
    dst: tuple
    width: int
    height: int
    depth: int


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of n (>= 1) that is at most cap (1 when cap < 1)."""
    best, i = 1, 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if best < d <= cap:
                    best = d
        i += 1
    return best


def plan_copy3d(row: int, heads: int, n: int, depth: int, a: CopySide, b: CopySide,
                max_pitch: int = MAX_PITCH) -> list[Copy3D]:
    """The cuMemcpy3D copies that move rows [0, n) of `heads` heads of `depth` layers from
    side a to side b (rows of `row` bytes), no pitch past max_pitch (the driver refuses a
    pitch over CU_DEVICE_ATTRIBUTE_MAX_PITCH, 2^31 - 1 bytes).

    One copy when a head (head_rows * row bytes) fits a pitch on both sides: y = the head
    (pitch: a head), z = the layer (height: a layer's heads). Otherwise (a head past 2 GiB:
    capacity * row > 2^31 - 1) one copy per layer in rows of d positions, d the largest
    divisor of n and of both head_rows with d * row <= max_pitch: y = d positions of the
    head (pitch d * row), z = the head (height head_rows / d), so the n rows of a head are
    n / d contiguous pieces and every pitch is at most max_pitch."""
    if max(a.head_rows, b.head_rows) * row <= max_pitch:
        return [Copy3D((a.device, a.address, a.head_rows * row, a.layer_heads),
                       (b.device, b.address, b.head_rows * row, b.layer_heads),
                       n * row, heads, depth)]
    g = math.gcd(n, a.head_rows, b.head_rows)
    d = largest_divisor_at_most(g, max_pitch // row)
    out = []
    for layer in range(depth):
        sides = [(x.device, x.address + layer * x.layer_heads * x.head_rows * row, d * row,
                  x.head_rows // d) for x in (a, b)]
        out.append(Copy3D(sides[0], sides[1], d * row, n // d, heads))
    return out


def range_limits(spec: KVSpec) -> str:
    """The input limits of a spec for messages: "|x| >= L", or for a K/V pair
    "|k| >= LK or |v| >= LV" (kvcore._quant.input_limit)."""
    if not spec.paired:
        return f"|x| >= {input_limit(spec.k_fmt.id)}"
    return f"|k| >= {input_limit(spec.k_fmt.id)} or |v| >= {input_limit(spec.v_fmt.id)}"


def _round32(n: int) -> int:
    return (n + 31) // 32 * 32


def _check_input(name: str, x: DeviceArray, expected) -> None:
    allowed = float_input_dtypes()
    if x.dtype not in allowed:
        names = ", ".join(str(a) for a in allowed)
        raise DTypeError(f"invalid dtype of {name}: expected one of {names}, got {x.dtype}")
    if x.ndim != 3 or any(not isinstance(e, str) and e != n for e, n in zip(expected, x.shape)):
        want = "[" + ", ".join(str(e) for e in expected) + "]"
        raise ShapeError(f"invalid shape of {name}: expected {want}, got {list(x.shape)}")
    isz = x.dtype.itemsize
    if x.shape[2] > 1 and x.strides[2] != isz or any(st % isz for st in x.strides):
        raise ShapeError(f"invalid strides of {name}: the last axis must be contiguous, "
                         f"got strides {list(x.strides)} bytes for itemsize {isz}")
    if x.ptr % isz:
        raise ShapeError(f"invalid address of {name}: 0x{x.ptr:x} is not aligned to {isz} bytes")
