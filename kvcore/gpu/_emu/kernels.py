"""kvcore's CUDA kernels compiled for the CPU: each module cuda/<module>.cu built by the host
C++ compiler against cuda/emu/ (the CUDA execution model: a fiber per thread, real
barriers and warp collectives, cp.async poisoned until its wait, shuffled thread order;
see docs/gpu.md, "Emulated kernels"), loaded with ctypes.

    mod = kernels.load("kv_append")            # built on first use, cached per user
    mod.entries["kv_advance"]                   # (ParamInfo(size=8, is_pointer=True), ...)
    mod.launch("kv_advance", (1, 1, 1), (32, 1, 1), 0, params, seed=0)  # KernelFault on a fault

The compiler is $CXX when set, else g++ on PATH (`find_compiler`; GpuUnavailableError when
there is none, or $CXX names nothing that runs). Builds are cached under
$XDG_CACHE_HOME/kvcore/emu (default ~/.cache/kvcore/emu), keyed by every byte of the
module's sources (its .cu, what it includes, cuda/emu/), its kernel names, the compiler's
command and version and the flags; a build writes a temporary file and
renames it, so concurrent processes never see half a library. Each use of a build renews
its modification time; a new build removes the builds of the same module (and variant)
beyond the KEEP_BUILDS most recently used that no process used for PRUNE_AFTER_S seconds,
so edited sources do not pile up libraries while a build another process may be about to
load is never removed.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ...errors import CudaError
from ...errors import GpuUnavailableError

FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off", "-DKVCORE_EMU")
ASAN_FLAGS = ("-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-ffp-contract=off", "-DKVCORE_EMU",
              "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
              "-fno-sanitize-recover=undefined")
_COMMON_FLAGS = ("-fvisibility=hidden", "-pthread")

_HERE = os.path.dirname(os.path.abspath(__file__))
_PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "_cuda")   # installed
_REPO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(_HERE))), "cuda")
_FAULTS = {1: "CUDA_ERROR_ILLEGAL_INSTRUCTION", 2: "CUDA_ERROR_ILLEGAL_ADDRESS",
           3: "CUDA_ERROR_LAUNCH_FAILED", 4: "CUDA_ERROR_INVALID_VALUE",
           5: "CUDA_ERROR_MISALIGNED_ADDRESS"}
_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+(\w+)", re.M)
_SOURCE_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
KEEP_BUILDS = 3           # builds kept per module and variant, however old
PRUNE_AFTER_S = 86400     # builds unused this long beyond those may be removed
_REDZONE = 256            # canary bytes after each allocation (builds without ASan)
_REDZONE_BYTE = 0xA5
_ALIGN = 256              # cuMemAlloc's alignment
_ERRBUF = 4096

_launch_lock = threading.Lock()   # one kernel at a time per process
_load_lock = threading.Lock()
_modules: dict[tuple[str, str, bool], "Module"] = {}
_source_override: str | None = None


class KernelFault(CudaError):
    """A kernel fault of the emulated device. code: the CUresult name it stands for
    (CUDA_ERROR_ILLEGAL_INSTRUCTION, CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_MISALIGNED_ADDRESS, CUDA_ERROR_NOT_FOUND);
    message names the kernel, block, thread and source file:line."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ParamInfo:
    """One kernel parameter, from the C++ signature: its size in bytes, and whether it is
    a pointer."""
    size: int
    is_pointer: bool


DEFAULT_COMPILER = "g++"
_HOW_TO_GET_ONE = ("install g++ (Debian/Ubuntu: apt-get install g++), or set CXX to the C++17 "
                   "compiler to use (a name on PATH or a path)")
_HOW_TO_FIX_CXX = f"set CXX to a working C++ compiler, or unset it to use {DEFAULT_COMPILER} from PATH"


def find_compiler() -> tuple[str, ...]:
    """The command of the host C++ compiler the emulator builds with: $CXX when set (split
    as a shell would: "ccache g++" works), else g++ on PATH; its first word resolved to a
    path. Raises GpuUnavailableError naming what was looked for when there is none, or when
    $CXX names nothing that runs (`CXX --version` must succeed)."""
    value = os.environ.get("CXX", "").strip()
    if not value:
        path = shutil.which(DEFAULT_COMPILER)
        if path is None:
            raise GpuUnavailableError(
                f"the GPU emulator needs a host C++ compiler: CXX is not set and there is no "
                f"{DEFAULT_COMPILER} on PATH; {_HOW_TO_GET_ONE}")
        return _runnable((path,), f"{DEFAULT_COMPILER} on PATH ({path})")
    try:
        words = shlex.split(value)
    except ValueError as e:
        raise GpuUnavailableError(f"CXX={value!r} is not a command ({e}); {_HOW_TO_FIX_CXX}") from None
    exe = words[0]
    if os.sep in exe or (os.altsep and os.altsep in exe):
        if not os.path.isfile(exe):
            why = "no such file"
        elif not os.access(exe, os.X_OK):
            why = "the file is not executable"
        else:
            why = None
        path = os.path.abspath(exe)
    else:
        path = shutil.which(exe)
        why = None if path else f"no {exe} on PATH"
    if why is not None:
        raise GpuUnavailableError(f"CXX={value!r} names no runnable C++ compiler: {why}; "
                                  f"{_HOW_TO_FIX_CXX}")
    return _runnable((path, *words[1:]), f"CXX={value!r}")


def _runnable(cmd: tuple[str, ...], what: str) -> tuple[str, ...]:
    """cmd, once `cmd --version` ran and succeeded (else GpuUnavailableError naming `what`)."""
    try:
        _compiler_version(cmd)
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        if what.startswith("CXX="):
            raise GpuUnavailableError(f"{what} names no runnable C++ compiler: {e}; "
                                      f"{_HOW_TO_FIX_CXX}") from None
        raise GpuUnavailableError(f"the GPU emulator's C++ compiler, {what}, does not run: {e}; "
                                  f"{_HOW_TO_GET_ONE}") from None
    return cmd


def compiler() -> str | None:
    """The host C++ compiler the emulator builds with, as a command line ($CXX when set,
    else g++ on PATH: see find_compiler), or None when there is none that runs."""
    try:
        return shlex.join(find_compiler())
    except GpuUnavailableError:
        return None


def available() -> bool:
    """Whether emulated kernels can be built here (a C++ compiler is installed)."""
    return compiler() is not None


def set_source_dir(path: str | None) -> None:
    """Builds every later load() from the CUDA sources in `path` (a copy of cuda/, e.g. with
    an injected bug: tools/emu_mutants.py) instead of kvcore's; None restores kvcore's."""
    global _source_override
    _source_override = None if path is None else os.path.abspath(path)


def default_source_dir() -> str:
    """The CUDA sources the emulator builds: set_source_dir's, else the repository's cuda/
    (editable install), else the installed package data kvcore/_cuda."""
    if _source_override is not None:
        return _source_override
    for d in (_REPO_DIR, _PKG_DIR):
        if os.path.exists(os.path.join(d, "emu", "module.cpp")):
            return d
    raise CudaError(f"no CUDA sources for the emulator in {_REPO_DIR} or {_PKG_DIR}")


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvcore", "emu")


def modules(src: str | None = None) -> list[str]:
    """The module names of a source directory (one per .cu file)."""
    src = src or default_source_dir()
    return sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(src, "*.cu")))


def load(module: str, *, asan: bool = False, source_dir: str | None = None) -> "Module":
    """The emulated module `module` (cuda/<module>.cu), built on first use and loaded once
    per process (later edits of the sources need a new process). asan: the
    AddressSanitizer + UBSan build (the process must have libasan preloaded).
    Raises CudaError naming the compiler error when the build fails."""
    src = os.path.abspath(source_dir) if source_dir else default_source_dir()
    key = (module, src, asan)
    mod = _modules.get(key)  # sources are read once per process
    if mod is None:
        path = _build(module, src, asan)
        with _load_lock:
            mod = _modules.get(key) or Module(module, path)
            _modules[key] = mod
    return mod


def build_all(*, asan: bool = False, source_dir: str | None = None) -> list["Module"]:
    """Builds (or finds in the cache) every module of the sources, in parallel, and loads them."""
    src = os.path.abspath(source_dir) if source_dir else default_source_dir()
    names = sorted(modules(src), key=lambda m: ("attention_" not in m, m))  # longest first
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda m: _build(m, src, asan), names))
    return [load(m, asan=asan, source_dir=src) for m in names]


class Module:
    """One loaded emulated module. entries: every extern "C" kernel with its parameters."""

    def __init__(self, name: str, path: str):
        self.name = name
        self.path = path
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise CudaError(f"loading the emulated module {name} ({path}) failed: {e}"
                            + (" (an ASan build needs libasan preloaded: tools/emu_asan.py)"
                               if "asan" in os.path.basename(path) else "")) from None
        self._lib = lib
        lib.kvemu_kernel_name.restype = ctypes.c_char_p
        lib.kvemu_launch.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                                     ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p), ctypes.c_ulonglong,
                                     ctypes.c_char_p, ctypes.c_int]
        lib.kvemu_shared_bytes.restype = ctypes.c_ulonglong
        self._index: dict[str, int] = {}
        entries = {}
        for i in range(lib.kvemu_kernel_count()):
            kname = lib.kvemu_kernel_name(i).decode()
            self._index[kname] = i
            entries[kname] = tuple(ParamInfo(lib.kvemu_kernel_param_size(i, j),
                                             bool(lib.kvemu_kernel_param_is_pointer(i, j)))
                                   for j in range(lib.kvemu_kernel_nparams(i)))
        self.entries: dict[str, tuple[ParamInfo, ...]] = entries

    def shared_bytes(self) -> int:
        """Bytes of the module's shared-memory area (every kernel's __shared__ variables)."""
        return int(self._lib.kvemu_shared_bytes())

    def launch(self, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int],
               shmem: int, params, seed: int) -> None:
        """Runs the whole grid on the calling thread (the GIL released), one launch at a
        time per process. params: a ctypes array of c_void_p, one pointer per argument
        value (cuLaunchKernel's kernelParams). Raises KernelFault."""
        i = self._index.get(kernel)
        if i is None:
            raise KernelFault("CUDA_ERROR_NOT_FOUND", f"module {self.name} has no kernel {kernel!r}")
        nparams = len(self.entries[kernel])
        if len(params) != nparams:
            raise KernelFault("CUDA_ERROR_INVALID_VALUE",
                              f"{kernel} takes {nparams} parameters, got {len(params)}")
        g = (ctypes.c_uint * 3)(*_dims("grid", grid))
        b = (ctypes.c_uint * 3)(*_dims("block", block))
        err = ctypes.create_string_buffer(_ERRBUF)
        argv = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p)) if nparams else None
        with _launch_lock:
            code = self._lib.kvemu_launch(i, g, b, int(shmem), argv, int(seed) & (2**64 - 1),
                                          err, _ERRBUF)
        if code:
            raise KernelFault(_FAULTS.get(code, "CUDA_ERROR_LAUNCH_FAILED"), err.value.decode(errors="replace"))


def _dims(what: str, dims) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in dims)
    if len(dims) != 3 or any(d < 0 or d >= 2**32 for d in dims):
        raise KernelFault("CUDA_ERROR_INVALID_VALUE", f"{what} {dims}: expected three unsigned ints")
    return dims


# ---- building ------------------------------------------------------------------------

@functools.cache
def _compiler_version(cmd: tuple[str, ...]) -> str:
    """The first line `cmd --version` prints; RuntimeError when it fails, OSError when it
    does not start."""
    res = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        err = (res.stderr or res.stdout).strip().splitlines()
        raise RuntimeError(f"`{shlex.join(cmd)} --version` exited {res.returncode}"
                           + (f": {err[-1]}" if err else ""))
    return res.stdout.strip().splitlines()[0] if res.stdout.strip() else shlex.join(cmd)


def _kernel_names(src: str, module: str) -> list[str]:
    """The module's kernels: the .entry lines of its shipped PTX, else (sources without
    PTX, e.g. test kernels) the extern "C" __global__ definitions of the .cu."""
    ptx = os.path.join(src, module + ".ptx")
    if os.path.exists(ptx):
        with open(ptx, encoding="utf-8") as f:
            names = _ENTRY.findall(f.read())
    else:
        with open(os.path.join(src, module + ".cu"), encoding="utf-8") as f:
            names = _SOURCE_ENTRY.findall(f.read())
    if not names:
        raise CudaError(f"emulated module {module}: no kernels found in {src}")
    return names


_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.M)


def _includes(path: str, seen: set[str] | None = None) -> set[str]:
    """`path` and every file it includes with #include "..." (found beside the includer),
    recursively: the sources a module's build depends on besides cuda/emu/."""
    seen = set() if seen is None else seen
    path = os.path.normpath(path)
    if path in seen or not os.path.exists(path):
        return seen
    seen.add(path)
    with open(path, "rb") as f:
        for inc in _INCLUDE.findall(f.read()):
            _includes(os.path.join(os.path.dirname(path), inc.decode()), seen)
    return seen


def _emu_dir(src: str) -> str:
    own = os.path.join(src, "emu")
    if os.path.exists(os.path.join(own, "module.cpp")):
        return own
    for d in (_REPO_DIR, _PKG_DIR):
        if os.path.exists(os.path.join(d, "emu", "module.cpp")):
            return os.path.join(d, "emu")
    raise CudaError(f"no cuda/emu/ for the emulator next to {src}, in {_REPO_DIR} or {_PKG_DIR}")


def _build(module: str, src: str, asan: bool) -> str:
    """The cached shared library of `module`, compiled now if missing."""
    cxx = find_compiler()
    if not os.path.exists(os.path.join(src, module + ".cu")):
        raise CudaError(f"emulated module {module}: no {module}.cu in {src}")
    emu = _emu_dir(src)
    names = _kernel_names(src, module)
    label = "cuda" if os.path.basename(src) in ("cuda", "_cuda") else os.path.basename(src)
    flags = [*(ASAN_FLAGS if asan else FLAGS), *_COMMON_FLAGS]
    files = sorted(_includes(os.path.join(src, module + ".cu")) | set(glob.glob(os.path.join(emu, "*"))))
    return _cached(module, f"module {module}", asan, cxx, [" ".join(flags), module, " ".join(names), label], files, src,
                   lambda out: [*cxx, *flags, "-I", emu, "-I", src, f'-DKVEMU_SOURCE="{module}.cu"',
                                "-DKVEMU_KERNELS=" + " ".join(f"X({n})" for n in names),
                                f"-fmacro-prefix-map={src}/={label}/",
                                os.path.join(emu, "module.cpp"), "-o", out])


def libcuda(*, asan: bool = False) -> str:
    """The emulated libcuda.so.1 (cuda/emu/libcuda.cpp: its cuGetProcAddress, which hands out
    the emulated driver's entry points), built on first use and cached as the modules are."""
    cxx = find_compiler()
    emu = _emu_dir(default_source_dir())
    source = os.path.join(emu, "libcuda.cpp")
    flags = [*(ASAN_FLAGS if asan else FLAGS), *_COMMON_FLAGS, "-Wl,-soname,libcuda.so.1"]
    return _cached("libcuda", "libcuda.so.1", asan, cxx, [" ".join(flags)], [source], emu,
                   lambda out: [*cxx, *flags, source, "-o", out])


def _cached(stem: str, what: str, asan: bool, cxx: tuple[str, ...], parts: list[str], files: list[str],
            root: str, command) -> str:
    """The cached library <stem>-<key>.so, where the key hashes the compiler (command and
    version), `parts` and every byte of `files` (named relative to `root`); built now by
    `command(path)` into a temporary file renamed into place when missing."""
    key = hashlib.sha256()
    for part in (shlex.join(cxx), _compiler_version(cxx), *parts):
        key.update(part.encode() + b"\0")
    for path in files:
        with open(path, "rb") as f:
            key.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    out_dir = cache_dir()
    out = os.path.join(out_dir, f"{stem}-{key.hexdigest()[:24]}{'-asan' if asan else ''}.so")
    if os.path.exists(out):
        try:
            os.utime(out)    # used now: not pruned for PRUNE_AFTER_S
        except OSError:
            pass             # a read-only cache still serves
        return out
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{out}.{os.getpid()}.{threading.get_ident()}.tmp"
    res = subprocess.run(command(tmp), capture_output=True, text=True)
    if res.returncode != 0:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise CudaError(f"building the emulated {what} failed ({os.path.basename(cxx[0])} "
                        f"exit {res.returncode}):\n{res.stderr[-8000:]}")
    os.replace(tmp, out)
    prune(stem, asan)
    return out


def prune(module: str, asan: bool, *, now: float | None = None) -> list[str]:
    """Removes the cached builds of `module` (asan: its ASan variant) beyond the
    KEEP_BUILDS most recently used that are older than PRUNE_AFTER_S; returns their paths.
    A process that loaded one keeps it mapped; files that vanish meanwhile are skipped."""
    pattern = re.compile(re.escape(module) + r"-[0-9a-f]{24}" + ("-asan" if asan else "") + r"\.so$")
    out_dir, now = cache_dir(), time.time() if now is None else now
    builds = []
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else ():
        if pattern.fullmatch(name):
            try:
                builds.append((os.stat(os.path.join(out_dir, name)).st_mtime, name))
            except FileNotFoundError:
                pass
    removed = []
    for mtime, name in sorted(builds, reverse=True)[KEEP_BUILDS:]:
        if now - mtime > PRUNE_AFTER_S:
            try:
                os.unlink(os.path.join(out_dir, name))
                removed.append(os.path.join(out_dir, name))
            except FileNotFoundError:
                pass
    return removed


# ---- device memory ----------------------------------------------------------------------

_libc = ctypes.CDLL(None)
_libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]
_alloc_lock = threading.Lock()
_allocations: dict[int, int] = {}


def asan_present() -> bool:
    """libasan is in the process: its malloc has redzones of its own, no canary then."""
    return hasattr(_libc, "__asan_init")


def alloc(nbytes: int) -> int:
    """Emulated device memory: C memory of nbytes (256-byte aligned as cuMemAlloc's) filled
    with poison (0xFF: NaN bits for f32/f16/bf16), followed (without ASan) by a 256-byte
    canary that free() checks. Raises CudaError when out of memory."""
    nbytes = int(nbytes)
    pad = 0 if asan_present() else _REDZONE
    p = ctypes.c_void_p()
    if _libc.posix_memalign(ctypes.byref(p), _ALIGN, max(nbytes, 1) + pad) != 0 or not p.value:
        raise CudaError(f"emulated cuMemAlloc: cannot allocate {nbytes} bytes of host memory")
    ctypes.memset(p.value, 0xFF, nbytes)
    ctypes.memset(p.value + nbytes, _REDZONE_BYTE, pad)
    with _alloc_lock:
        _allocations[p.value] = nbytes
    return p.value


def free(ptr: int) -> None:
    """Poisons and frees memory from alloc(). Raises KernelFault (CUDA_ERROR_ILLEGAL_ADDRESS)
    when the canary after it was overwritten (a kernel wrote past its end); it is freed
    all the same."""
    with _alloc_lock:
        nbytes = _allocations.pop(int(ptr), None)
    if nbytes is None:
        raise CudaError(f"emulated cuMemFree: 0x{int(ptr):x} is not an allocation of the emulator")
    pad = 0 if asan_present() else _REDZONE
    tail = ctypes.string_at(ptr + nbytes, pad)
    ctypes.memset(ptr, 0xFF, nbytes)
    _libc.free(ptr)
    bad = [i for i, b in enumerate(tail) if b != _REDZONE_BYTE]
    if bad:
        raise KernelFault("CUDA_ERROR_ILLEGAL_ADDRESS",
                          f"bytes {bad[0]}..{bad[-1]} past the end of the allocation 0x{int(ptr):x} "
                          f"of {nbytes} bytes were overwritten: a kernel or copy wrote out of bounds")
