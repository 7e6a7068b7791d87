"""One exception hierarchy, rooted at KVCacheError.

Each subclass also derives from the matching built-in, so callers can catch either
`kvcore.ShapeError` or plain `ValueError`.
"""


class KVCacheError(Exception):
    """Root of every error kvcore raises on purpose."""


class SpecError(KVCacheError, ValueError):
    """A KVSpec (or a request built from one) is invalid: sizes, GQA ratio, format."""


class FormatError(KVCacheError, ValueError):
    """An unknown storage format, or a format that does not fit the operation."""


class ShapeError(KVCacheError, ValueError):
    """An array has the wrong number of dimensions or the wrong shape."""


class DTypeError(KVCacheError, TypeError):
    """An array has a dtype the operation does not take."""


class NonFiniteError(KVCacheError, ValueError):
    """An input holds NaN or +-inf."""


class CapacityError(KVCacheError, IndexError):
    """A write would go past the cache's capacity."""


class OutOfRangeError(KVCacheError, IndexError):
    """A layer, slot or position index is outside its range."""


class RangeError(KVCacheError, ValueError):
    """A number outside what the call takes or can compute with: a thread count, a softmax
    scale or RoPE theta, sizes past a C int, attention scores past the float32 range."""


class StateError(KVCacheError, RuntimeError):
    """The call does not fit the cache's state: unequal pending steps, a cache in use by
    another thread, a freed buffer, a capturing stream, a stale CUDA graph."""


class SnapshotError(KVCacheError, ValueError):
    """A snapshot (object or file) is corrupt, inconsistent or does not fit the cache."""


class StoreError(KVCacheError, OSError):
    """A chunk store's backend failed: a server that cannot be reached or answered with an
    error, a directory that cannot be read or written. The message names the backend (the
    server's address or the directory) and the operation."""


class ChunkError(KVCacheError, ValueError):
    """A stored chunk value is truncated, corrupt, of another format or version, or does
    not match its key, model, shapes or tokens (a chunk store reports it as a miss)."""


class CudaError(KVCacheError, RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUresult."""


class GpuUnavailableError(KVCacheError, ImportError):
    """What the GPU layer needs is not installed: cuda-python (for a real device), or a host
    C++ compiler (for the emulator, `use_emulator()`). The message names what is missing
    and how to get it."""


class DeviceCopyError(KVCacheError, TypeError):
    """copy.copy, copy.deepcopy or pickle of a GPU object that owns device memory or a
    driver handle: a copy would share it (and free it twice), a pickle cannot carry it. The
    message says how to move the content instead (e.g. `snapshot()`, then `restore()`)."""


__all__ = [
    "KVCacheError", "SpecError", "FormatError", "ShapeError", "DTypeError",
    "NonFiniteError", "CapacityError", "OutOfRangeError", "RangeError", "StateError",
    "SnapshotError", "StoreError", "ChunkError", "CudaError", "GpuUnavailableError",
    "DeviceCopyError",
]
