"""CPU-only checks of the GPU layer: lazy imports, is_available, layout arithmetic, memory
fit, argument validation, the shared device constants, and the checked-in PTX."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import kvcore
from kvcore.gpu.cache import GPU_FORMATS, GPU_PAIRS   # the formats and K/V pairs the GPU kernels hold
from kvcore import FORMATS, KVSpec, SpecError
from kvcore.gpu import GpuKVCache, GpuLayout, is_available, max_slots_for_memory
from kvcore.gpu import cache as gpu_cache
from kvcore.gpu import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_import_needs_no_cuda_python():
    out = _run("import sys, kvcore, kvcore.gpu; "
               "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))")
    assert out == "[]"


def test_is_available_false_without_cuda_python():
    # a missing module (sys.modules entry None makes the import fail) answers False
    out = _run("import sys; sys.modules['cuda'] = None; "
               "from kvcore import gpu; print(gpu.is_available())")
    assert out == "False"


def test_is_available_never_raises():
    assert is_available() in (True, False)


# A child process in which `cuda` and `cuda.*` do not import, whether or not cuda-python is
# installed here: a meta-path finder ahead of every other refuses them.
_REFUSE_CUDA = """
import importlib.abc, json, sys
class RefuseCuda(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, RefuseCuda())
"""


def test_gpu_objects_without_cuda_python_raise_a_clear_error():
    out = _run(_REFUSE_CUDA + """
import numpy as np
import kvcore
from kvcore import KVSpec, gpu
spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=32, num_heads=4)
class Foreign:   # a CUDA array of another library
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (4096, False), "version": 3}
makers = {
    "GpuKVCache": lambda: gpu.GpuKVCache(spec, 2),
    "GpuKVCache.fit": lambda: gpu.GpuKVCache.fit(spec),
    "GpuKVPool": lambda: gpu.GpuKVPool(spec, 8, max_batch=1, max_pages_per_seq=2),
    "Context.get": lambda: gpu.Context.get(),
    "DeviceBuffer.alloc": lambda: gpu.DeviceBuffer.alloc(16),
    "DeviceBuffer.from_numpy": lambda: gpu.DeviceBuffer.from_numpy(np.zeros(4)),
    "Stream.create": lambda: gpu.Stream.create(),
    "Event.create": lambda: gpu.Event.create(),
    "as_device_array": lambda: gpu.as_device_array(Foreign()),
    "use_emulator": lambda: gpu.use_emulator(),   # the emulator runs under the bindings too
}
got = {}
for name, make in makers.items():
    try:
        make()
        got[name] = "no error"
    except Exception as e:
        got[name] = [type(e).__name__, isinstance(e, ImportError), isinstance(e, kvcore.KVCacheError), str(e)]
got["is_available"] = gpu.is_available()
got["cuda modules"] = sorted(m for m in sys.modules if m == "cuda" or m.startswith("cuda."))
print(json.dumps(got))
""")
    got = json.loads(out.splitlines()[-1])
    assert got.pop("is_available") is False
    assert got.pop("cuda modules") == []
    message = ('cuda-python is not installed: pip install "kvcore[cuda]" (kvcore\'s GPU layer calls '
               'the driver through its bindings, on a GPU and under kvcore.gpu.use_emulator() alike)')
    for name, result in got.items():
        assert result == ["GpuUnavailableError", True, True, message], name


def test_gpu_unavailable_error_is_an_import_error_of_kvcore():
    from kvcore.gpu import GpuUnavailableError
    assert issubclass(GpuUnavailableError, ImportError)
    assert issubclass(GpuUnavailableError, kvcore.KVCacheError)


@pytest.mark.parametrize("fmt", GPU_FORMATS + GPU_PAIRS)
@pytest.mark.parametrize("slots", [1, 3, 7])
def test_layout_arithmetic(fmt, slots):
    spec = KVSpec(num_layers=3, num_kv_heads=5, head_dim=64, capacity=37, format=fmt)
    lay = GpuLayout(spec, slots)
    off, total = lay.offsets, 0
    for region in ("k_codes", "v_codes", "k_scales", "v_scales"):
        f = spec.k_fmt if region[0] == "k" else spec.v_fmt   # each side in its own format
        codes = region.endswith("codes")
        width = f.code_width(64) if codes else f.scales_per_row(64)   # W = 32 bytes for q4_0 / q4_1
        dtype = f.code_dtype if codes else f.scale_dtype
        assert lay.shape(region) == (3, slots, 5, 37, width)
        if dtype is not None:
            assert lay.strides(region) == np.empty(lay.shape(region), dtype).strides
        nbytes = 3 * slots * 5 * 37 * width * (dtype.itemsize if dtype is not None else 0)
        assert lay.region_bytes(region) == nbytes
        assert off[region] % 256 == 0 and off[region] >= total   # in order, 256-byte aligned
        total = off[region] + nbytes
        # slot (layer 2, slot s) starts where the [L][M][Hkv][N][W] index says
        for s in range(slots):
            want = ((2 * slots + s) * 5 * 37 * width) * (dtype.itemsize if dtype is not None else 0)
            assert lay.slot_offset(region, 2, s) == off[region] + want
    assert total <= lay.data_bytes < total + 4 * 256
    m = lay.meta_offsets
    assert m["v_codes"] == 3 * slots * 8 and m["lengths"] == 4 * 3 * slots * 8
    assert m["status"] == m["lengths"] + 4 * slots and lay.meta_bytes == m["status"] + 4 * slots
    assert lay.total_bytes == lay.data_bytes + lay.meta_bytes


@pytest.mark.parametrize("fmt", ["f16", "int8", "q8_0"])
def test_max_slots_for_memory_is_exact(fmt):
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=128, capacity=1000, format=fmt)
    for free in (0, GpuLayout(spec, 1).total_bytes - 1, GpuLayout(spec, 1).total_bytes,
                 10**7, 123_456_789, 10**9):
        for reserve in (0, 1_000_000):
            m = max_slots_for_memory(spec, free, reserve)
            budget = free - reserve
            if m == 0:
                assert GpuLayout(spec, 1).total_bytes > budget
            else:
                assert GpuLayout(spec, m).total_bytes <= budget < GpuLayout(spec, m + 1).total_bytes


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_max_slots_for_memory_validates(bad):
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=32, capacity=8)
    with pytest.raises(SpecError, match="free_bytes must be a non-negative int"):
        max_slots_for_memory(spec, bad)
    with pytest.raises(SpecError, match="reserve_bytes must be a non-negative int"):
        max_slots_for_memory(spec, 100, bad)


def test_cache_validates_before_touching_a_device():
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=32, capacity=8)
    with pytest.raises(kvcore.DTypeError, match="invalid type of spec: expected KVSpec"):
        GpuKVCache("spec")
    for bad in (0, -2, 1.0, True):
        with pytest.raises(SpecError, match="slots must be a positive int"):
            GpuKVCache(spec, bad)


def test_every_format_and_gpu_pair_has_kernels():
    assert GPU_FORMATS == tuple(kvcore.formats.ROW_FORMATS)    # q4_1ch (K by channel): CPU only
    for fmt in GPU_FORMATS + GPU_PAIRS:
        assert os.path.exists(os.path.join(ROOT, "cuda", f"attention_{fmt.replace('/', '_')}.ptx"))


@pytest.mark.parametrize("fmt", ["q4_0/q8_0", "f16/int8", "int8/f16"])
def test_kv_pairs_without_gpu_kernels_are_refused(fmt):
    """K and V in two formats other than GPU_PAIRS' have no GPU kernels: every GPU object
    refuses the spec before touching a device, naming both formats and the pairs it holds."""
    from kvcore.gpu import GpuKVPool
    k, v = fmt.split("/")
    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=64, capacity=8, format=fmt)
    msg = (rf"K format {k} and V format {v}: the GPU kernels hold one format for both or the "
           rf"K/V pairs q8_0/q4_0, f16/q4_0(, q4_1ch/q4_1, q4_1ch/q4_0)? \(KVCache")  # (GpuKVCache's)
    for make in (lambda: GpuKVCache(spec), lambda: GpuKVCache.fit(spec), lambda: GpuLayout(spec, 1),
                 lambda: max_slots_for_memory(spec, 2**30),
                 lambda: GpuKVPool(spec, 4, 4, max_batch=1, max_pages_per_seq=2)):
        with pytest.raises(kvcore.FormatError, match=msg):
            make()


def _defines(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#define (KV_\w+) (\S+)", text, re.M))


def test_device_constants_match_python():
    with open(os.path.join(ROOT, "cuda", "common.cuh")) as f:
        d = _defines(f.read())
    for name, fmt in FORMATS.items():
        if not fmt.group:                 # q4_1ch (K by channel) is CPU-only: no device id
            assert int(d["KV_" + name.upper()]) == fmt.id
    assert int(d["KV_Q8_0_BLOCK"]) == int(d["KV_QK"]) == kvcore.formats.Q8_0_BLOCK == kvcore.formats.QK
    assert int(d["KV_ERR_CAPACITY"]) == gpu_cache.ERR_CAPACITY
    assert int(d["KV_ERR_NONFINITE"]) == gpu_cache.ERR_NONFINITE
    assert int(d["KV_ERR_RANGE"]) == gpu_cache.ERR_RANGE
    from kvcore import _quant
    limit = {name: np.float32(_quant.input_limit(f.id)) for name, f in FORMATS.items()}
    assert np.float32(d["KV_Q8_0_LIMIT"].rstrip("f")) == limit["q8_0"]
    assert np.float32(d["KV_Q4_0_LIMIT"].rstrip("f")) == limit["q4_0"]
    assert d["KV_Q4_1_LIMIT"] == "KV_F16_LIMIT" and limit["q4_1"] == limit["f16"]
    assert np.float32(d["KV_F16_LIMIT"].rstrip("f")) == limit["f16"]
    assert np.uint32(int(d["KV_BF16_LIMIT_BITS"], 16)).view(np.float32) == limit["bf16"]
    assert np.uint32(int(d["KV_INT8_LIMIT_BITS"], 16)).view(np.float32) == limit["int8"]


def test_ptx_is_found():
    path = kernels.ptx_path("kv_append")
    with open(path) as f:
        text = f.read()
    assert ".entry kv_append(" in text and ".entry kv_advance(" in text
    assert ".target sm_80" in text


def test_every_kernel_cuts_out_of_its_module_alone():
    """kernels.py loads each kernel alone (_ptx.entry_image): sound while a shipped module
    declares nothing at module scope past its header, and a module of several kernels has
    no .func (rope.ptx's one kernel calls one: its cut is the whole module)."""
    from kvcore.gpu import _ptx
    ptx_dir = os.path.dirname(kernels.ptx_path("rope"))
    for name in sorted(os.listdir(ptx_dir)):
        if not name.endswith(".ptx"):
            continue
        with open(os.path.join(ptx_dir, name), "rb") as f:
            text = f.read()
        entries = _ptx.parse(text).entries
        assert len(entries) == 1 or b".func" not in text, name   # one kernel: the cut is all
        header = text[:text.index(b"\t// .globl")]
        assert re.sub(rb"//[^\n]*", b"", header).split() == [
            b".version", b"7.0", b".target", b"sm_80", b".address_size", b"64"], name
        total = len(header)
        for kernel, params in entries.items():
            image = _ptx.entry_image(text, kernel)
            cut = _ptx.parse(image)
            assert list(cut.entries) == [kernel] and cut.entries[kernel] == params
            total += len(image) - len(header)
        assert total == len(text.rstrip(b"\0")), name    # the cuts cover the module
    with pytest.raises(_ptx.PtxError, match="no kernel 'kv_nothing'"):
        _ptx.entry_image(text, "kv_nothing")


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_a_kernel_cut_out_assembles_alone(tmp_path):
    from kvcore.gpu import _ptx
    with open(kernels.ptx_path("kv_append"), "rb") as f:
        (tmp_path / "cut.ptx").write_bytes(_ptx.entry_image(f.read(), "kv_advance"))
    res = subprocess.run(["ptxas", "-arch=sm_90", "-o", str(tmp_path / "cut.cubin"),
                          str(tmp_path / "cut.ptx")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None,
                    reason="nvcc/ptxas not on PATH")
@pytest.mark.child([sys.executable, os.path.join(ROOT, "tools", "build_ptx.py"), "--check",
                    "--no-cache", "--jobs", "1", "--no-ptxas"])
def test_build_ptx_check(child):
    assert child.returncode == 0, child.stdout + child.stderr


def test_build_py_ships_cuda_sources_ptx_and_the_emulator(tmp_path):
    # a non-editable install must be able to build the emulated kernels: every PTX, .cu,
    # .cuh and the emulator's headers land in kvcore/_cuda/, the emulator's package beside
    res = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    cuda = os.path.join(ROOT, "cuda")
    assert os.path.isdir(os.path.join(cuda, "emu")), "cuda/emu/ (the emulator's headers) is missing"
    wanted = [os.path.relpath(os.path.join(d, f), cuda) for d, _, files in os.walk(cuda) for f in files
              if f.endswith((".ptx", ".cu", ".cuh")) or os.path.basename(d) == "emu"]
    assert len([w for w in wanted if w.endswith(".ptx")]) == 17
    missing = [w for w in wanted if not os.path.isfile(os.path.join(tmp_path, "kvcore", "_cuda", w))]
    assert not missing, missing
    for module in ("_emu/__init__.py", "_emu/driver.py", "_emu/kernels.py", "_ptx.py"):
        assert os.path.isfile(os.path.join(tmp_path, "kvcore", "gpu", module)), module
    assert os.path.isfile(os.path.join(tmp_path, "kvcore", "_cuda", "emu", "libcuda.cpp"))
