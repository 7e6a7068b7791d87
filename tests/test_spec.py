"""KVSpec validation and byte counts; the format table; the error hierarchy."""
import numpy as np
import pytest

import kvcore
from kvcore import FORMATS, FormatError, KVSpec, SpecError
from kvcore.formats import get_format, view_dtype


def spec(**kw):
    args = dict(num_layers=32, num_kv_heads=8, head_dim=128, capacity=4096)
    args.update(kw)
    return KVSpec(**args)


def test_defaults_and_byte_counts():
    s = spec(format="int8")
    assert s.num_heads == 8 and s.group_size == 1
    assert s.rows_per_position == 2 * 32 * 8
    assert s.bytes_per_position == 2 * 32 * 8 * (128 + 4)
    assert s.memory_bytes == 4096 * s.bytes_per_position
    assert s.fp32_equivalent_bytes == 4096 * 2 * 32 * 8 * 128 * 4
    assert s.compression_ratio == pytest.approx(3.8788, abs=1e-4)
    assert spec(format="f16").memory_bytes == 4096 * 2 * 32 * 8 * 128 * 2
    assert spec(format="q8_0").bytes_per_position == 2 * 32 * 8 * (128 + 4 * 2)
    assert spec(num_heads=32).group_size == 4


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "capacity", "num_heads"])
@pytest.mark.parametrize("value, match", [(0, "must be positive, got 0"), (-3, "must be positive, got -3"),
                                          (2.0, "must be an int, got float"),
                                          (True, "must be an int, got bool"),
                                          ("8", "must be an int, got str")])
def test_sizes_are_validated(field, value, match):
    with pytest.raises(SpecError, match=f"{field} {match}"):
        spec(**{field: value})


def test_numpy_ints_are_taken():
    s = spec(num_layers=np.int64(4), capacity=np.int32(10))
    assert s.num_layers == 4 and type(s.num_layers) is int and s.capacity == 10


def test_gqa_ratio():
    with pytest.raises(SpecError, match="num_heads=12, num_kv_heads=8"):
        spec(num_heads=12)


def test_format_is_checked():
    with pytest.raises(FormatError, match="unknown format 'int4': expected one of f32, f16"):
        spec(format="int4")
    with pytest.raises(FormatError, match="q8_0 needs head_dim divisible by 32, got 48"):
        spec(format="q8_0", head_dim=48)
    assert spec(format=FORMATS["bf16"]).format == "bf16"


def test_byte_counts_that_overflow_are_refused():
    with pytest.raises(SpecError, match="overflows a 64-bit size"):
        spec(capacity=2**60)


def test_replace_validates_again():
    s = spec(format="fp8_e4m3")
    assert s.replace(capacity=7).capacity == 7 and s.replace(capacity=7).format == "fp8_e4m3"
    with pytest.raises(SpecError):
        s.replace(num_kv_heads=0)


@pytest.mark.parametrize("name, code, scales, scale_bytes", [
    ("f32", "float32", 0, 0), ("f16", "float16", 0, 0), ("bf16", "uint16", 0, 0),
    ("int8", "int8", 1, 4), ("fp8_e4m3", "uint8", 1, 4), ("fp8_e5m2", "uint8", 1, 4),
    ("q8_0", "int8", 4, 8)])
def test_format_table(name, code, scales, scale_bytes):
    f = get_format(name)
    assert f.code_dtype == np.dtype(code) and f.id == list(FORMATS).index(name)
    assert f.scales_per_row(128) == scales and f.scale_row_bytes(128) == scale_bytes
    assert f.row_bytes(128) == 128 * f.code_bytes + scale_bytes
    assert f.quantized == (name in kvcore.QUANTIZED_FORMATS) == (scales > 0)
    assert view_dtype(name).itemsize == f.code_bytes


def test_view_dtypes_with_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert view_dtype("bf16") == ml_dtypes.bfloat16
    assert view_dtype("fp8_e4m3") == ml_dtypes.float8_e4m3fn
    assert view_dtype("fp8_e5m2") == ml_dtypes.float8_e5m2
    assert view_dtype("int8") == np.int8


def test_errors_derive_from_builtins():
    assert issubclass(kvcore.ShapeError, ValueError) and issubclass(kvcore.DTypeError, TypeError)
    assert issubclass(kvcore.CapacityError, IndexError) and issubclass(kvcore.OutOfRangeError, IndexError)
    assert issubclass(kvcore.StateError, RuntimeError)
    for name in kvcore.errors.__all__:
        assert issubclass(getattr(kvcore, name), kvcore.KVCacheError)


# -- K/V pairs: K and V in different formats ------------------------------------------

def test_pair_formats_and_byte_counts():
    s = spec(k_format="q8_0", v_format="q4_0")
    assert (s.k_format, s.v_format, s.format) == ("q8_0", "q4_0", "q8_0/q4_0")
    assert s.k_fmt is FORMATS["q8_0"] and s.v_fmt is FORMATS["q4_0"] and s.paired
    assert s.fmts == (FORMATS["q8_0"], FORMATS["q4_0"])
    # per position and layer and head: K 128 + 4 * 2 bytes, V 64 + 4 * 2 bytes
    assert s.bytes_per_position == 32 * 8 * ((128 + 8) + (64 + 8))
    assert s.memory_bytes == 4096 * s.bytes_per_position
    assert spec(format="q8_0/q4_0") == s == spec(format="q8_0/q4_0", v_format="q4_0")
    assert s.replace(capacity=8).format == "q8_0/q4_0"
    assert s.replace(v_format="q8_0") == spec(format="q8_0")
    assert s.replace(format="int8").format == "int8"
    with pytest.raises(FormatError, match="stores K as q8_0 and V as q4_0: spec.fmt names one "
                                          "format for both; use spec.k_fmt / spec.v_fmt"):
        s.fmt
    same = spec(k_format="int8", v_format="int8")
    assert same.format == "int8" and same.fmt is FORMATS["int8"] and not same.paired
    assert same == spec(format="int8")
    # a side not given takes format=, whose default is f16 (llama.cpp's -ctk alone)
    assert spec(k_format="q8_0").format == "q8_0/f16"
    assert spec(v_format="q4_0").format == "f16/q4_0"


def test_pair_errors_name_the_side_and_the_numbers():
    with pytest.raises(SpecError, match=r"format='int8' stores K as int8, but k_format='q8_0'"):
        spec(format="int8", k_format="q8_0")
    with pytest.raises(SpecError, match=r"format='q8_0/q4_0' stores V as q4_0, but "
                                        r"v_format='f16'"):
        spec(format="q8_0/q4_0", v_format="f16")
    with pytest.raises(FormatError, match="v_format: unknown format 'q3_k': expected one of"):
        spec(k_format="q8_0", v_format="q3_k")
    with pytest.raises(FormatError, match="K format: unknown format 'int4'"):
        spec(format="int4/q4_0")
    with pytest.raises(FormatError, match="unknown format pair 'a/b/c'"):
        spec(format="a/b/c")
    with pytest.raises(FormatError, match="V format q4_0 needs head_dim divisible by 32, got 48"):
        spec(k_format="f16", v_format="q4_0", head_dim=48)
    with pytest.raises(FormatError, match="K format q4_1 needs head_dim divisible by 32, got 80"):
        spec(k_format="q4_1", v_format="f16", head_dim=80)
    with pytest.raises(FormatError, match="'q8_0/q4_0' names a K/V pair, not one format"):
        get_format("q8_0/q4_0")


def test_pickles_of_specs_before_pairs_load():
    """A KVSpec pickled by a kvcore before K/V pairs (its state has no k_format /
    v_format) loads as one format for both."""
    import pickle
    s = spec(format="q8_0")
    old = {k: v for k, v in s.__dict__.items() if k not in ("k_format", "v_format")}
    back = KVSpec.__new__(KVSpec)
    back.__setstate__(old)
    assert back == s and back.fmt is FORMATS["q8_0"]
    assert pickle.loads(pickle.dumps(spec(format="q8_0/q4_0"))) == spec(format="q8_0/q4_0")


def test_q4_1ch_is_a_k_format():
    # KIVI: K by channel over groups of 32 positions, V per token; q4_1's bytes per row
    s = spec(k_format="q4_1ch", v_format="q4_1")
    assert s.format == "q4_1ch/q4_1" and s.k_fmt.group == 32
    assert s.bytes_per_position == spec(format="q4_1").bytes_per_position
    for bad in (dict(format="q4_1ch"), dict(k_format="q4_1", v_format="q4_1ch")):
        with pytest.raises(FormatError, match=r"V format q4_1ch stores values by channel over "
                                              r"groups of 32 positions, a K layout"):
            spec(**bad)
    with pytest.raises(FormatError, match="K format q4_1ch needs head_dim divisible by 32, got 48"):
        KVSpec(num_layers=1, num_kv_heads=1, head_dim=48, capacity=64, k_format="q4_1ch",
               v_format="f16")
