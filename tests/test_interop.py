"""Arrays from any library (issue 18, item 1): every CPU entry point takes numpy arrays,
DLPack arrays (torch CPU tensors here, and a pure-Python exporter so the path is tested
without torch) and buffer-protocol objects, reads them in place and writes out= arrays
into the caller's memory; arrays on another device, arrays that refuse to export and
read-only outputs are refused with the cache unchanged."""
import array
import ctypes
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import kvcore
from kvcore import DTypeError, KVCache, KVPool, KVSpec, ShapeError
from kvcore._validate import check_ndarray

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)


def spec(fmt="int8", *, layers=2, heads=2, head_dim=64, capacity=32, num_heads=4):
    return KVSpec(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, capacity=capacity,
                  num_heads=num_heads, format=fmt)


class Exporter:
    """The smallest DLPack producer: hands out the capsule of a numpy array it holds, on the
    device it claims; `code` relabels the capsule's dtype (e.g. 4, kDLBfloat, over a uint16
    array: a bfloat16 producer); `calls` counts exports."""

    def __init__(self, arr, device=(1, 0), code=None):
        self.arr, self.device, self.code, self.calls = arr, device, code, 0

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls += 1
        capsule = self.arr.__dlpack__(max_version=max_version)
        if self.code is not None:
            get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
                ("PyCapsule_GetPointer", ctypes.pythonapi))
            # DLManagedTensorVersioned: version (8 bytes), manager, deleter, flags (8 each),
            # then the DLTensor, which the legacy DLManagedTensor starts with. DLTensor: data
            # (8), device (8), ndim (4), then dtype {code u8, bits u8, lanes u16}.
            try:
                at = get(capsule, b"dltensor_versioned") + 32
            except ValueError:
                at = get(capsule, b"dltensor")
            ctypes.c_uint8.from_address(at + 20).value = self.code
        return capsule

    def __dlpack_device__(self):
        return self.device


def torch_bf16_as_numpy(t):
    """The reference view of a torch bfloat16 tensor, through torch's own int16 view."""
    return t.view(torch.int16).numpy().view(BF16)


def frozen(target):
    """The bytes and counts a refused call must leave as they are."""
    if isinstance(target, KVCache):
        return target._storage.tobytes(), target.length, target.pending(0)
    return target._storage.tobytes(), [target.length(s) for s in target.sequences]


# ------------------------------------------------------------- the one helper

def test_helper_takes_every_kind_in_place():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for x, addr in ((base, base.ctypes.data), (t, t.data_ptr()), (t[:, ::2], t.data_ptr()),
                    (Exporter(base), base.ctypes.data), (memoryview(base), base.ctypes.data)):
        a = check_ndarray("x", x)
        assert type(a) is np.ndarray and a.ctypes.data == addr
    assert check_ndarray("x", t[:, ::2]).strides == (24, 8)
    buf = array.array("f", range(8))
    a = check_ndarray("x", buf)
    a[3] = 42
    assert buf[3] == 42 and a.dtype == np.float32


def test_helper_reads_bfloat16_and_float8():
    t = torch.randn(3, 5).to(torch.bfloat16)
    a = check_ndarray("k", t)
    assert a.dtype == BF16 and a.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(a.view(np.uint16), torch_bf16_as_numpy(t).view(np.uint16))
    for tdt, mdt in ((torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
                     (torch.float8_e5m2, ml_dtypes.float8_e5m2)):
        t8 = torch.randn(7).to(tdt)
        a8 = check_ndarray("codes", t8)
        assert a8.dtype == np.dtype(mdt)
        np.testing.assert_array_equal(a8.astype(np.float32), t8.float().numpy())
    # the same path without torch: a uint16 capsule relabelled as kDLBfloat, versioned and
    # legacy (a producer older than DLPack 1.0 takes no max_version)
    class Legacy(Exporter):
        def __dlpack__(self, stream=None):
            return super().__dlpack__()
    bits = np.array([0x3F80, 0xC000, 0x7F7F], np.uint16)
    for producer in (Exporter(bits, code=4), Legacy(bits, code=4)):
        a = check_ndarray("k", producer)
        assert a.dtype == BF16 and a.ctypes.data == bits.ctypes.data
        assert a.tolist() == [1.0, -2.0, float(bits.view(BF16)[2])]


def test_bfloat16_without_ml_dtypes_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)   # import ml_dtypes -> ImportError
    with pytest.raises(DTypeError, match=r"invalid dtype of k: bfloat16 arrays need ml_dtypes"):
        check_ndarray("k", Exporter(np.zeros(4, np.uint16), code=4))


def test_helper_refuses_with_reasons():
    with pytest.raises(DTypeError, match=r"invalid type of q: expected an array \(numpy, "
                                         r"DLPack or the buffer protocol\), got list"):
        check_ndarray("q", [1.0, 2.0])
    cuda = Exporter(np.zeros(4, np.float32), device=(2, 1))
    with pytest.raises(DTypeError, match=r"invalid device of q: expected an array in host "
                                         r"memory \(cpu\), got a Exporter on cuda:1 \(copy it"):
        check_ndarray("q", cuda)
    assert cuda.calls == 0   # the device is asked first: nothing is exported
    with pytest.raises(DTypeError, match=r"on device type 99:0"):
        check_ndarray("q", Exporter(np.zeros(4, np.float32), device=(99, 0)))
    with pytest.raises(DTypeError, match=r"invalid type of x: Tensor refused to export its "
                                         r"memory through DLPack: .*gradient"):
        check_ndarray("x", torch.zeros(3, requires_grad=True))
    with pytest.raises(DTypeError, match=r"invalid dtype of x: numpy does not read this "
                                         r"Exporter through DLPack"):
        check_ndarray("x", Exporter(np.zeros(4, np.uint8), code=9))   # float8_e4m3b11fnuz


def test_nothing_imports_torch():
    """The DLPack path runs without torch in the process (a pure-Python exporter)."""
    code = """
        import sys
        import numpy as np
        import kvcore
        x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
        class E:
            def __dlpack__(self, **kw): return x.__dlpack__(**kw)
            def __dlpack_device__(self): return x.__dlpack_device__()
        codes, scales = kvcore.quantize(E(), "int8")
        assert (codes == kvcore.quantize(x, "int8")[0]).all()
        kvcore.quantize(memoryview(x), "f16")
        assert "torch" not in sys.modules, "kvcore imported torch"
        print("ok")
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# ------------------------------------------------------------- KVCache and KVPool writes

@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "q8_0"])
def test_cache_append_torch_equals_numpy(fmt):
    """f32, f16 and bf16 tensors, contiguous, transposed and strided, write exactly the bytes
    their numpy twins write."""
    g = torch.Generator().manual_seed(1)
    a, b = KVCache(spec(fmt)), KVCache(spec(fmt))
    k32 = torch.randn(5, 2, 64, generator=g)
    wide = torch.randn(5, 2, 128, generator=g)
    inputs = [
        (k32, k32.to(torch.float16)),                                   # contiguous
        (k32.transpose(0, 1).contiguous().transpose(0, 1), k32.to(torch.bfloat16)),
        (wide[:, :, ::2], wide[:, :, 1::2].to(torch.bfloat16)),         # element stride 2
        (k32[1], k32[2].to(torch.float16)),                             # [Hkv, D]
    ]
    for k, v in inputs:
        a.append(0, k, v)
        kn = k.numpy()
        vn = torch_bf16_as_numpy(v) if v.dtype == torch.bfloat16 else v.numpy()
        b.append(0, kn, vn)
    a.append(1, k32, k32)
    b.append(1, k32.numpy(), k32.numpy())
    assert a._storage.tobytes() == b._storage.tobytes()


def test_pool_append_and_batch_take_tensors():
    g = torch.Generator().manual_seed(2)
    a, b = KVPool(spec("int8"), num_pages=8, page_size=4), KVPool(spec("int8"), num_pages=8,
                                                                   page_size=4)
    k = torch.randn(7, 2, 64, generator=g)
    v = torch.randn(7, 2, 64, generator=g).to(torch.bfloat16)
    for pool, conv in ((a, lambda t: t), (b, lambda t: torch_bf16_as_numpy(t)
                                          if t.dtype == torch.bfloat16 else t.numpy())):
        s0, s1 = pool.new_sequence(), pool.new_sequence()
        pool.append(conv(k[:3]), conv(v[:3]), seq=s0, layer=0)
        pool.append_batch(conv(k[3:]), conv(v[3:]), seqs=[s0, s1], layer=0,
                          counts=torch.tensor([1, 3]) if pool is a else np.array([1, 3]))
    assert a._storage.tobytes() == b._storage.tobytes()
    assert a.pending(1, 0) == 3


def test_refused_tensors_change_nothing():
    cache = KVCache(spec("int8"))
    ok = torch.randn(2, 2, 64)
    before = frozen(cache)
    for bad, error, match in (
            (torch.randn(2, 2, 64, requires_grad=True), DTypeError, "gradient"),
            (Exporter(np.zeros((2, 2, 64), np.float32), device=(2, 0)), DTypeError, "cuda:0"),
            (torch.randn(2, 2, 64, dtype=torch.float64), DTypeError, "got float64"),
            (torch.randn(2, 2, 32), ShapeError, r"invalid shape of v"),
            (torch.tensor([[[float("nan")] * 64] * 2] * 2), kvcore.NonFiniteError, "v")):
        with pytest.raises(error, match=match):
            cache.append(0, ok, bad)
        assert frozen(cache) == before
    pool = KVPool(spec("int8"), num_pages=4, page_size=4)
    s = pool.new_sequence()
    before = frozen(pool)
    with pytest.raises(DTypeError, match="cuda:0"):
        pool.append(Exporter(np.zeros((2, 2, 64), np.float32), device=(2, 0)), ok, seq=s, layer=0)
    with pytest.raises(DTypeError, match="gradient"):
        pool.append_batch(ok[:1], torch.zeros(1, 2, 64, requires_grad=True), seqs=[s], layer=0)
    assert frozen(pool) == before


# ------------------------------------------------------------- quantize / dequantize

@pytest.mark.parametrize("fmt", ["int8", "q8_0", "fp8_e4m3", "bf16"])
def test_quantize_dequantize_out_tensors(fmt):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 64, generator=g)
    x_strided = x[:, ::2]                                   # [4, 2, 64], not contiguous
    codes_ref, scales_ref = kvcore.quantize(x_strided.numpy(), fmt)
    codes, scales = kvcore.quantize(x_strided, fmt)         # read in place
    np.testing.assert_array_equal(codes.view(np.uint8), codes_ref.view(np.uint8))
    # out= torch tensors: the result lands in the caller's tensors, returned as given
    code_dtype = {"int8": torch.int8, "q8_0": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
                  "bf16": torch.bfloat16}[fmt]
    oc = torch.empty(4, 2, 64, dtype=code_dtype)
    os_ = None if scales_ref is None else torch.empty(
        scales_ref.shape, dtype={np.dtype(np.float32): torch.float32,
                                 np.dtype(np.float16): torch.float16}[scales_ref.dtype])
    out = (oc, os_)
    assert kvcore.quantize(x_strided, fmt, out=out) is out
    np.testing.assert_array_equal(oc.view(torch.uint8).numpy(), codes_ref.view(np.uint8))
    if os_ is not None:
        np.testing.assert_array_equal(os_.numpy(), scales_ref)
    # and back: dequantize from the tensors into a torch out
    ref = kvcore.dequantize(codes_ref, scales_ref, fmt)
    dst = torch.empty(4, 2, 64)
    assert kvcore.dequantize(oc, os_, fmt, out=dst) is dst
    np.testing.assert_array_equal(dst.numpy(), ref)
    np.testing.assert_array_equal(kvcore.dequantize(oc, os_, fmt), ref)


def test_out_tensors_must_be_writable_and_contiguous():
    x = np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)
    codes, scales = kvcore.quantize(x, "int8")
    t = torch.empty(64, 2).t()                              # [2, 64], not contiguous
    with pytest.raises(ShapeError, match="out must be a writable C-contiguous array"):
        kvcore.dequantize(codes, scales, "int8", out=t)
    ro = np.zeros((2, 64), np.float32)
    ro.flags.writeable = False                              # exported with the read-only flag
    with pytest.raises(ShapeError, match="out must be a writable C-contiguous array"):
        kvcore.dequantize(codes, scales, "int8", out=Exporter(ro))
    with pytest.raises(ShapeError, match="out must be a writable"):
        kvcore.dequantize(codes, scales, "int8", out=memoryview(bytes(512)).cast("f", (2, 64)))


# ------------------------------------------------------------- attention, RoPE, merge

@pytest.mark.parametrize("fmt", ["f16", "int8"])
def test_decode_attention_q_and_out_tensors(fmt):
    g = torch.Generator().manual_seed(5)
    cache = KVCache(spec(fmt))
    cache.append(0, torch.randn(9, 2, 64, generator=g), torch.randn(9, 2, 64, generator=g))
    cache.append(1, torch.randn(9, 2, 64, generator=g), torch.randn(9, 2, 64, generator=g))
    cache.advance()
    q = torch.randn(3, 8, 64, generator=g)[:, ::2]           # [3, 4, 64], strided
    ref, lse_ref = kvcore.decode_attention(q.numpy(), cache, 0, return_lse=True)
    out = torch.full((3, 4, 64), float("nan"))
    r, lse = kvcore.decode_attention(q, cache, 0, out=out, return_lse=True)
    assert r is out
    np.testing.assert_array_equal(out.numpy(), ref)
    np.testing.assert_array_equal(lse, lse_ref)
    qc = q.contiguous()
    assert kvcore.decode_attention(qc, cache, 0, out=qc) is qc   # out may be q itself
    np.testing.assert_array_equal(qc.numpy(), ref)
    before = out.clone()
    with pytest.raises(DTypeError, match="cuda:0"):
        kvcore.decode_attention(q, cache, 0, out=Exporter(np.empty((3, 4, 64), np.float32),
                                                          device=(2, 0)))
    with pytest.raises(DTypeError, match="gradient"):
        kvcore.decode_attention(torch.zeros(3, 4, 64, requires_grad=True), cache, 0, out=out)
    assert torch.equal(out, before)


def test_pool_attention_and_exports_into_tensors():
    g = torch.Generator().manual_seed(6)
    pool = KVPool(spec("int8"), num_pages=8, page_size=4)
    s0, s1 = pool.new_sequence(), pool.new_sequence()
    for layer in range(2):
        pool.append_batch(torch.randn(9, 2, 64, generator=g), torch.randn(9, 2, 64, generator=g),
                          seqs=[s0, s1], layer=layer, counts=[4, 5])
    pool.advance()
    q = torch.randn(2, 4, 64, generator=g)
    out = torch.empty(2, 4, 64)
    assert kvcore.decode_attention(q, pool, 0, seqs=[s0, s1], out=out) is out
    np.testing.assert_array_equal(out.numpy(),
                                  kvcore.decode_attention(q.numpy(), pool, 0, seqs=[s0, s1]))
    bt = torch.empty(2, 3, dtype=torch.int32)
    assert pool.block_tables([s0, s1], bt) is bt
    np.testing.assert_array_equal(bt.numpy(), pool.block_tables([s0, s1], np.empty((2, 3),
                                                                                   np.int32)))
    indptr, indices, last = (torch.empty(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32),
                             torch.empty(2, dtype=torch.int32))
    nnz = pool.csr([s0, s1], indptr, indices, last)
    assert indptr.tolist() == [0, 1, nnz] and last.tolist() == [4, 1]
    assert indices[:nnz].tolist() == pool.page_table(s0).tolist() + pool.page_table(s1).tolist()
    slots = torch.empty(4, dtype=torch.int64)
    assert pool.slot_mapping([s0, s1], torch.tensor([1, 2]), slots) is slots
    assert slots[-1].item() == -1 and slots[0].item() // 4 == pool.page_table(s0)[-1]


def test_apply_rope_in_place_on_tensors():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 64, generator=g)
    ref = kvcore.apply_rope(x.numpy().copy(), np.array([0, 5, 9]))
    assert kvcore.apply_rope(x, torch.tensor([0, 5, 9])) is x
    np.testing.assert_array_equal(x.numpy(), ref)
    big = torch.randn(3, 4, 128, generator=g)
    view = big[:, :, 32:96]                                  # strided: rows of 64 in 128
    ref = kvcore.apply_rope(view.numpy().copy(), np.array([1, 2, 3]), style="norm")
    kvcore.apply_rope(view, [1, 2, 3], style="norm")
    np.testing.assert_array_equal(big[:, :, 32:96].numpy(), ref)
    ro = np.ones((4, 64), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ShapeError, match="x must be writable"):
        kvcore.apply_rope(Exporter(ro), 3)


def test_merge_attention_takes_tensors():
    g = torch.Generator().manual_seed(8)
    o1, o2 = torch.randn(2, 4, 64, generator=g), torch.randn(2, 4, 64, generator=g)
    l1, l2 = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    o, lse = kvcore.merge_attention(o1, l1, o2, l2)
    ro, rl = kvcore.merge_attention(o1.numpy(), l1.numpy(), o2.numpy(), l2.numpy())
    np.testing.assert_array_equal(o, ro)
    np.testing.assert_array_equal(lse, rl)


def test_dlpack_path_ignores_other_modules_ctypes_settings(monkeypatch):
    """Another module (kvcore.gpu.memory does) may set argtypes on the shared
    ctypes.pythonapi capsule functions; the DLPack path uses function objects of its own."""
    for fn in ("PyCapsule_IsValid", "PyCapsule_GetPointer"):
        monkeypatch.setattr(getattr(ctypes.pythonapi, fn), "argtypes",
                            [ctypes.c_void_p, ctypes.c_char_p])
    t = torch.arange(6, dtype=torch.float32).to(torch.bfloat16)
    assert check_ndarray("k", t).astype(np.float32).tolist() == [0, 1, 2, 3, 4, 5]


def test_token_ids_from_a_tensor():
    """Prefix keys (the chunk store's) take input ids as a torch tensor like a list."""
    from kvcore._prefix_keys import token_array
    ids = [5, 0, 2**40, 7]
    for tokens in (torch.tensor(ids), torch.tensor([x for i in ids for x in (i, 1)])[::2], np.array(ids)):
        np.testing.assert_array_equal(token_array(tokens), np.array(ids, np.int64))
    with pytest.raises(DTypeError, match="expected a 1-D integer array"):
        token_array(torch.zeros(3))
