"""The shipped kernels: each kernel of a PTX module (cuda/<name>.ptx, installed as
kvcore/_cuda/) is loaded alone, cut out of its module, once per context with
cuModuleLoadDataEx (the driver JIT-compiles only it); a failed JIT raises CudaError carrying
the JIT log and the driver's version. No compilation at run time beyond the driver's PTX
JIT. The PTX declares ISA 7.0 (tools/build_ptx.py), which drivers from CUDA 11.0 on read.

    fn = kernels.function("kv_append", "kv_append")   # a Kernel: handle + the .entry's sizes
    driver.launch(fn, grid, block, [(ptr, None), (n, ctypes.c_int)], stream=s)
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import CudaError
from . import _ptx, driver
from .driver import Context

_PKG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_cuda")
_REPO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cuda")
_LOG_BYTES = 16384
# The kernels' input dtype ids (kv_load_input), by numpy dtype name: q, k and v arrays.
INPUT_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


def ptx_path(module: str) -> str:
    """The PTX of `module`: the installed package data, else (editable install) cuda/."""
    for d in (_PKG_DIR, _REPO_DIR):
        path = os.path.join(d, module + ".ptx")
        if os.path.exists(path):
            return path
    raise CudaError(f"cuModuleLoadData: no PTX for module {module!r} in {_PKG_DIR} or "
                    f"{_REPO_DIR} (build it with tools/build_ptx.py)")


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel: its CUfunction `handle` and the byte size of each parameter its PTX
    `.entry` declares (`params`), which driver.launch checks every launch against: the
    driver reads kernelParams blindly."""
    module: str
    name: str
    handle: object
    params: tuple[int, ...]


def _load(ctx: Context, module: str, kernel: str):
    """(CUmodule, .entry parameter sizes) of `kernel` alone, cut out of `module`'s PTX
    (_ptx.entry_image): the driver JIT-compiles what it loads, and an attention module
    holds 32 kernel instances of which a model uses one or two."""
    with open(ptx_path(module), "rb") as f:
        text = f.read()
    try:
        image = _ptx.entry_image(text, kernel) + b"\0"
    except _ptx.PtxError as e:
        raise CudaError(f"cuModuleLoadDataEx({module}.ptx, {kernel}): {e}") from None
    params = tuple(p.size for p in _ptx.parse(image).entries[kernel])
    drv = driver.cuda()
    opt = drv.CUjit_option
    log = bytearray(_LOG_BYTES)
    options = [opt.CU_JIT_ERROR_LOG_BUFFER, opt.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
    with ctx:
        err, handle = drv.cuModuleLoadDataEx(image, len(options), options, [log, _LOG_BYTES])
    if err != drv.CUresult.CUDA_SUCCESS:
        jit = bytes(log).split(b"\0")[0].decode(errors="replace").strip()
        raise CudaError(f"cuModuleLoadDataEx({module}.ptx, {kernel}): {driver._error_text(err)}; "
                        f"the driver is {driver.driver_version_text()}"
                        + (f"\nJIT log:\n{jit}" if jit else ""))
    return handle, params


def function(module: str, kernel: str, ctx: Context | None = None) -> Kernel:
    """The Kernel `kernel` of PTX module `module`, loaded (alone) once per context."""
    ctx = ctx or Context.get()
    fn = ctx.modules.get((module, kernel))
    if fn is None:
        handle, params = _load(ctx, module, kernel)
        with ctx:
            fh = driver.call("cuModuleGetFunction", handle, kernel.encode())
        fn = ctx.modules[(module, kernel)] = Kernel(module, kernel, fh, params)
    return fn
