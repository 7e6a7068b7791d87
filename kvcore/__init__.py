"""kvcore: the key/value cache of transformer decoding.

Public API; everything else lives behind a leading underscore.
"""
from . import _omp_env
_omp_env.short_spin()   # before the OpenMP runtime loads (kvcore/_omp_env.py)
try:
    from . import _cpu as _cpu
except ImportError:   # a source tree whose extensions were never compiled
    raise ImportError(
        f"kvcore's compiled extensions are missing (no kvcore._cpu beside {__file__}): this "
        "copy of kvcore was not built. "
        "Install it with pip (it compiles the Cython kernels: a C compiler with OpenMP is "
        "needed), or in a checkout run: pip install -e .") from None
_cpu.check()   # before any kernel module: an ImportError, not an illegal instruction
from . import _parallel   # loads the OpenMP runtime, which reads its wait policy
_omp_env.restore()
from .errors import (CapacityError, ChunkError, CudaError, DeviceCopyError, DTypeError,
                     FormatError, GpuUnavailableError, KVCacheError, NonFiniteError,
                     OutOfRangeError, RangeError, ShapeError, SnapshotError, SpecError,
                     StateError, StoreError)
from .formats import FORMATS, QUANTIZED_FORMATS, Format, get_format
from .spec import KVSpec
from .cache import KVCache
from .pool import KVPool, PoolStats
from ._parallel import max_threads, openmp_enabled, set_num_threads
from .quant import dequantize, quantize
from .snapshot import Snapshot, load_snapshot
from .attention import apply_rope, decode_attention, merge_attention
from .store import DirectoryBackend, KVStore, RedisBackend, StoreWriter
from .rope import rope_frequencies

__version__ = "0.1.0"

__all__ = [
    "CapacityError", "CudaError", "DeviceCopyError", "DTypeError", "GpuUnavailableError", "FormatError", "KVCacheError",
    "NonFiniteError", "OutOfRangeError", "RangeError", "ShapeError", "SnapshotError", "SpecError",
    "StateError", "StoreError", "ChunkError", "KVStore", "DirectoryBackend", "RedisBackend",
    "StoreWriter", "FORMATS", "QUANTIZED_FORMATS", "Format", "get_format", "KVSpec", "KVCache",
    "KVPool", "PoolStats",
    "max_threads", "openmp_enabled", "set_num_threads", "quantize", "dequantize",
    "Snapshot", "load_snapshot", "decode_attention", "merge_attention", "apply_rope",
    "rope_frequencies", "__version__",
]
