"""Snapshots: take/restore on a KVCache, requantize, safetensors files (round trip, the
safetensors library as an independent reader, atomic save, every refusal), and prefix
reuse end to end."""
import json
import mmap
import os
import struct

import numpy as np
import pytest
from _formats import PAIRS, sides
from safetensors import safe_open

import kvcore
from kvcore import KVCache, KVSpec, Snapshot, SnapshotError, load_snapshot
from kvcore.formats import ROW_FORMATS as FORMATS   # K and V in one format (q4_1ch is K only)
from kvcore.errors import DTypeError, OutOfRangeError
from kvcore.snapshot import _metadata_digest

PARTS = ("k_codes", "v_codes", "k_scales", "v_scales")
ALL = list(FORMATS) + PAIRS   # the formats, and K/V pairs ("<k>/<v>")


def small_spec(fmt, **kw):
    fields = dict(num_layers=3, num_kv_heads=2, head_dim=32, capacity=12, format=fmt)
    fields.update(kw)
    return KVSpec(**fields)


def fill(cache, rng, steps, *, t=1):
    """Appends `steps` batches of t random positions to every layer, advancing each."""
    s = cache.spec
    for _ in range(steps):
        for layer in range(s.num_layers):
            k, v = (rng.standard_normal((t, s.num_kv_heads, s.head_dim)).astype(np.float32)
                    for _ in range(2))
            cache.append(layer, k, v)
        cache.advance()


def filled_cache(fmt, rng, n=7, **kw):
    cache = KVCache(small_spec(fmt, **kw))
    fill(cache, rng, n)
    return cache


def assert_same_snapshot(a: Snapshot, b: Snapshot):
    assert a.spec == b.spec and a.length == b.length
    for name in PARTS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert x.tobytes() == y.tobytes(), name


def assert_cache_holds(cache, snap: Snapshot):
    """The cache's committed positions are byte-for-byte the snapshot's, nothing pending."""
    assert cache.length == snap.length
    for layer in range(cache.spec.num_layers):
        assert cache.pending(layer) == 0
        views = (cache.keys(layer), cache.values(layer),
                 cache.key_scales(layer), cache.value_scales(layer))
        for name, view in zip(PARTS, views):
            part = getattr(snap, name)
            if part is None:
                assert view is None
            else:
                assert view.tobytes() == part[layer].tobytes(), (name, layer)


def random_snapshot(fmt, rng, length=5, **kw):
    """A Snapshot of valid codes and scales, built without a cache."""
    spec = small_spec(fmt, **kw)
    shape = (spec.num_layers, length, spec.num_kv_heads, spec.head_dim)
    parts = {}
    for which, f in zip("kv", spec.fmts):
        codes, scales = kvcore.quantize(rng.standard_normal(shape).astype(np.float32), f)
        parts[f"{which}_codes"] = codes.view(f.code_dtype)
        if scales is not None:
            parts[f"{which}_scales"] = scales
    return Snapshot(spec, length, **parts)


# ---------------------------------------------------------------- take / restore

@pytest.mark.parametrize("fmt", ALL)
def test_take_copies_committed_positions(fmt, rng):
    cache = filled_cache(fmt, rng, 6)
    full = cache.snapshot()
    assert full.length == 6 and full.spec == cache.spec
    assert_cache_holds(cache, full)
    part = cache.snapshot(4)
    for name in PARTS:
        if getattr(full, name) is not None:
            assert np.array_equal(getattr(part, name), getattr(full, name)[:, :4])
            assert not np.shares_memory(getattr(part, name), cache._storage)
    assert part.nbytes == 4 * cache.spec.bytes_per_position


def test_take_leaves_pending_out(rng):
    cache = filled_cache("int8", rng, 3)
    cache.append(0, np.ones((2, 2, 32), np.float32), np.ones((2, 2, 32), np.float32))
    assert cache.snapshot().length == 3


def test_take_refuses_bad_n(rng):
    cache = filled_cache("f16", rng, 3)
    with pytest.raises(OutOfRangeError, match=r"snapshot of 4 positions out of range: "
                                              r"expected 0 <= n <= length 3"):
        cache.snapshot(4)
    with pytest.raises(OutOfRangeError, match="-1 positions"):
        cache.snapshot(-1)
    with pytest.raises(DTypeError, match="expected int or None, got float"):
        cache.snapshot(2.0)
    assert cache.snapshot(np.int64(0)).length == 0


@pytest.mark.parametrize("fmt", ALL)
def test_restore_replaces_content(fmt, rng):
    snap = filled_cache(fmt, rng, 5).snapshot()
    target = filled_cache(fmt, rng, 9)
    target.append(1, np.ones((1, 2, 32), np.float32), np.ones((1, 2, 32), np.float32))
    target.restore(snap)
    assert_cache_holds(target, snap)
    for layer in range(3):
        ref = kvcore.dequantize(snap.k_codes[layer], None if snap.k_scales is None
                                else snap.k_scales[layer], sides(fmt)[0])
        assert np.array_equal(target.dequantize(layer, "k"), ref)


def test_restore_of_empty_snapshot_empties(rng):
    cache = filled_cache("q8_0", rng, 4)
    cache.restore(cache.snapshot(0))
    assert cache.length == 0 and cache.keys(0).shape == (0, 2, 32)


def test_restore_takes_other_num_heads_and_capacity(rng):
    snap = filled_cache("int8", rng, 5).snapshot()
    cache = KVCache(small_spec("int8", num_heads=4, capacity=5))
    cache.restore(snap)
    assert_cache_holds(cache, snap)


@pytest.mark.parametrize("change, match", [
    (dict(num_layers=2), "snapshot num_layers 3 does not match the cache's 2"),
    (dict(num_kv_heads=1), "snapshot num_kv_heads 2 does not match the cache's 1"),
    (dict(head_dim=64), "snapshot head_dim 32 does not match the cache's 64"),
    (dict(format="fp8_e4m3"), r"snapshot format int8 does not match the cache's fp8_e4m3 "
                              r"\(pass requantize=True"),
    (dict(capacity=4), "snapshot of 5 positions exceeds the cache's capacity 4"),
])
def test_restore_refuses_mismatch_untouched(change, match, rng):
    snap = filled_cache("int8", rng, 5).snapshot()
    cache = KVCache(small_spec("int8", **change))
    fill(cache, rng, 2)
    before = cache._storage.tobytes()
    with pytest.raises(SnapshotError, match=match):
        cache.restore(snap)
    assert cache._storage.tobytes() == before and cache.length == 2


def test_restore_refuses_non_snapshot(rng):
    cache = filled_cache("f32", rng, 1)
    with pytest.raises(DTypeError, match="expected Snapshot, got dict"):
        cache.restore({})


@pytest.mark.parametrize("fmt, part, value, shown", [
    ("f32", "k_codes", np.float32(np.nan), "nan"),
    ("f16", "v_codes", np.float16(np.inf), "inf"),
    ("f16", "k_codes", np.float16(-np.inf), "-inf"),
    ("f16", "k_codes", np.float16(np.nan), "nan"),
    ("bf16", "k_codes", np.uint16(0x7F80), "32640"),  # +inf bits
    ("bf16", "v_codes", np.uint16(0xFFC1), "65473"),  # a negative NaN
    ("int8", "v_codes", np.int8(-128), "-128"),
    ("fp8_e4m3", "k_codes", np.uint8(0xFF), "255"),  # NaN
    ("fp8_e5m2", "k_codes", np.uint8(0x7C), "124"),  # +inf
    ("int8", "k_scales", np.float32(-1.0), "-1.0"),
    ("q8_0", "v_scales", np.float16(np.nan), "nan"),
])
def test_restore_refuses_impossible_values(fmt, part, value, shown, rng):
    snap = random_snapshot(fmt, rng)
    getattr(snap, part)[2, 4, 1, 0] = value
    cache = KVCache(snap.spec)
    before = cache._storage.tobytes()
    with pytest.raises(SnapshotError, match=rf"snapshot {part}\[2, 4, 1, 0\] = .*{shown}.* "
                                            rf"is not a value format {fmt} stores"):
        cache.restore(snap)
    assert cache._storage.tobytes() == before


@pytest.mark.parametrize("fmt, extremes", [("f16", np.float16([65504, -65504, 6e-8, -0.0])),
                                            ("bf16", np.uint16([0x7F7F, 0xFF7F, 0x0001, 0x8000]))])
def test_restore_takes_the_extreme_finite_values(fmt, extremes, rng):
    """The largest finite magnitudes, a subnormal and -0 of the 16-bit float formats are
    values (codes are checked by their exponent bits)."""
    snap = random_snapshot(fmt, rng)
    snap.k_codes[1, 3, 0, :4] = extremes
    cache = KVCache(snap.spec)
    cache.restore(snap)
    assert cache.keys(1)[3, 0, :4].tobytes() == extremes.tobytes()


@pytest.mark.parametrize("src", ALL)
@pytest.mark.parametrize("dst", ["f16", "int8", "fp8_e5m2", "q8_0", "q8_0/q4_0", "int8/f16"])
def test_restore_requantizes(src, dst, rng):
    """Each side decoded from its format and encoded in the target's (pairs both ways)."""
    snap = random_snapshot(src, rng)
    cache = KVCache(small_spec(dst))
    cache.restore(snap, requantize=True)
    assert cache.length == snap.length
    for layer in range(3):
        for which, view, scale_view in (("k", cache.keys, cache.key_scales),
                                        ("v", cache.values, cache.value_scales)):
            s, d = (sides(f)[which == "v"] for f in (src, dst))
            sc = getattr(snap, f"{which}_scales")
            x = kvcore.dequantize(getattr(snap, f"{which}_codes")[layer],
                                  None if sc is None else sc[layer], s)
            codes, scales = kvcore.quantize(x, d)
            assert view(layer).tobytes() == codes.tobytes()
            if scales is not None:
                assert scale_view(layer).tobytes() == scales.tobytes()


def test_requantize_refuses_values_past_the_target_range(rng):
    snap = random_snapshot("f32", rng)
    snap.k_codes[1, 2, 0, 5] = 1e6  # past float16's 65504: would be stored as inf
    cache = KVCache(small_spec("f16"))
    with pytest.raises(SnapshotError, match=r"cannot requantize the f32 snapshot to f16: k, "
                                            r"layer 1: value out of range of format f16"):
        cache.restore(snap, requantize=True)
    snap.k_codes[1, 2, 0, 5] = 1e7  # past q8_0's float16 block scale
    with pytest.raises(SnapshotError, match=r"cannot requantize the f32 snapshot to q8_0: "
                                            r"k, layer 1: value out of range of format q8_0"):
        KVCache(small_spec("q8_0")).restore(snap, requantize=True)


# ----------------------------------------------------------------------- files

@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("length", [0, 1, 5])
def test_save_load_round_trip(fmt, length, rng, tmp_path):
    snap = random_snapshot(fmt, rng, length)
    path = tmp_path / "s.safetensors"
    snap.save(path)
    loaded = load_snapshot(path)
    assert_same_snapshot(loaded, snap)
    assert os.listdir(tmp_path) == ["s.safetensors"]  # no temporary left behind
    for name in PARTS:
        arr = getattr(loaded, name)
        if arr is not None and arr.size:
            assert not arr.flags.writeable
            with pytest.raises(ValueError):   # its base is a read-only buffer
                arr.flags.writeable = True
            base = arr
            while isinstance(base, np.ndarray):
                base = base.base
            assert not isinstance(base.obj, mmap.mmap)  # private memory, no map of the file


@pytest.mark.parametrize("fmt", ["bf16", "q8_0"])
@pytest.mark.parametrize("writeback", [True, False])
def test_save_in_pieces(fmt, writeback, rng, tmp_path, monkeypatch):
    # the large-file path on a small file: pieces of an odd size that straddle tensors,
    # hashed on the worker thread, with and without starting write-back per piece
    import hashlib
    from kvcore import snapshot as mod
    monkeypatch.setattr(mod, "_PARALLEL_HASH_BYTES", 0)
    monkeypatch.setattr(mod, "_WRITE_CHUNK", 1000)
    if not writeback:
        monkeypatch.setattr(mod, "_sync_file_range", None)
    snap = random_snapshot(fmt, rng, length=9)
    snap.save(tmp_path / "s.safetensors")
    loaded = load_snapshot(tmp_path / "s.safetensors")
    assert_same_snapshot(loaded, snap)
    with safe_open(str(tmp_path / "s.safetensors"), framework="numpy") as f:
        meta = f.metadata()
    import xxhash
    for name in PARTS:
        if getattr(snap, name) is not None:
            data = getattr(snap, name).tobytes()
            assert meta[f"sha256_{name}"] == hashlib.sha256(data).hexdigest()
            assert meta[f"xxh3_128_{name}"] == xxhash.xxh3_128(data).hexdigest()


@pytest.mark.parametrize("fmt", FORMATS)
def test_files_read_by_the_safetensors_library(fmt, rng, tmp_path):
    snap = random_snapshot(fmt, rng)
    snap.save(tmp_path / "s.safetensors")
    with safe_open(str(tmp_path / "s.safetensors"), framework="numpy") as f:
        meta = f.metadata()
        names = set(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    assert names == {n for n in PARTS if getattr(snap, n) is not None}
    for name, arr in tensors.items():
        assert arr.dtype == getattr(snap, name).dtype
        assert arr.tobytes() == getattr(snap, name).tobytes()
    assert meta["format"] == fmt and meta["length"] == "5" and meta["num_layers"] == "3"
    assert meta["kvcore_version"] == kvcore.__version__ and meta["file_version"] == "2"


def test_save_replaces_atomically(rng, tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    old = random_snapshot("int8", rng)
    old.save(path)
    before = path.read_bytes()

    def crash(fd):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk gone"):
        random_snapshot("int8", rng, 2).save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.safetensors"]
    monkeypatch.undo()
    new = random_snapshot("q8_0", rng, 3)
    new.save(path)
    assert_same_snapshot(load_snapshot(path), new)


def test_save_onto_a_directory_leaves_no_temporary(rng, tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        random_snapshot("f16", rng).save(tmp_path / "d")
    assert os.listdir(tmp_path) == ["d"] and os.listdir(tmp_path / "d") == []


def test_save_load_snapshot_of_a_cache(rng, tmp_path):
    cache = filled_cache("fp8_e4m3", rng, 6)
    cache.snapshot().save(str(tmp_path / "c.safetensors"))
    other = KVCache(cache.spec)
    other.restore(load_snapshot(str(tmp_path / "c.safetensors")))
    assert other._storage.tobytes() == cache._storage.tobytes()


# The file layout the tests below corrupt: [u64 header length][JSON header][data].

def read_file(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_file(path, header, data, *, redigest=True):
    """Writes a header (re-signing its metadata, so deeper checks are reached) and data."""
    if redigest:
        header["__metadata__"]["sha256"] = _metadata_digest(header["__metadata__"])
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.fixture
def saved(rng, tmp_path):
    path = tmp_path / "s.safetensors"
    random_snapshot("int8", rng).save(path)
    return path


def edit_meta(**changes):
    def edit(header, data):
        header["__metadata__"].update(changes)
        return header, data
    return edit


def edit_tensor(name, key, value):
    def edit(header, data):
        header[name][key] = value
        return header, data
    return edit


@pytest.mark.parametrize("edit, match", [
    (edit_meta(file_version="4"), r"file version 4 is newer than this kvcore reads \(up to 3\)"),
    (edit_meta(file_version="0"), "unknown file version 0"),
    (edit_meta(format="int4"), "metadata format: unknown format 'int4'"),
    (edit_meta(format="f16"), r"metadata keys differ from a file of format f16: missing \[\], "
                              r"unexpected \['sha256_k_scales', 'sha256_v_scales', "
                              r"'xxh3_128_k_scales', 'xxh3_128_v_scales'\]"),
    (edit_meta(length="-1"), "metadata length must be a non-negative decimal integer"),
    (edit_meta(length="13"), "metadata length 13 exceeds capacity 12"),
    (edit_meta(head_dim="33"), "data section is 2160 bytes but the metadata describes 2220"),
    (edit_meta(num_layers="99999999999999999999"), "below 10\\*\\*19"),
    (edit_meta(num_heads="3"), "metadata spec: num_heads must be a multiple of num_kv_heads"),
    (edit_meta(length="4"), "data section is 2160 bytes but the metadata describes 1728"),
    (edit_tensor("k_codes", "dtype", "U8"), r"tensor k_codes: dtype 'U8' does not match the "
                                            r"metadata \(expected I8\)"),
    (edit_tensor("k_codes", "dtype", "F32"), "tensor k_codes: dtype 'F32'"),
    (edit_tensor("v_codes", "shape", [3, 5, 2, 16, 2]), r"tensor v_codes: shape \[3, 5, 2, 16, 2\] "
                                                        r"does not match the metadata"),
    (edit_tensor("v_codes", "shape", [3, 5, 2, 32.0]), "tensor v_codes: shape"),
    (edit_tensor("k_scales", "data_offsets", [0, 2**70]), r"data_offsets \[0, 118059"),
    (edit_tensor("k_scales", "data_offsets", [8, 128]), "k_scales starts at byte 8 of the data, "
                                                        "expected 0"),
    (edit_tensor("k_scales", "data_offsets", [120, 0]), "do not span its 120 bytes"),
    (edit_tensor("k_scales", "extra", 1), "expected an object with dtype, shape and data_offsets"),
])
def test_load_refuses_lying_headers(saved, edit, match):
    header, data = edit(*read_file(saved))
    write_file(saved, header, data)
    with pytest.raises(SnapshotError, match=match):
        load_snapshot(saved)


def test_load_refuses_a_spec_kvspec_refuses(rng, tmp_path):
    path = tmp_path / "q.safetensors"
    random_snapshot("q8_0", rng).save(path)
    header, data = read_file(path)
    header["__metadata__"]["head_dim"] = "16"
    write_file(path, header, data)
    with pytest.raises(SnapshotError, match="metadata spec: format q8_0 needs head_dim "
                                            "divisible by 32, got 16"):
        load_snapshot(path)


def test_load_refuses_edited_metadata_without_its_digest(saved):
    header, data = read_file(saved)
    header["__metadata__"]["capacity"] = "13"
    write_file(saved, header, data, redigest=False)
    with pytest.raises(SnapshotError, match="the metadata does not match its SHA-256"):
        load_snapshot(saved)


def test_load_refuses_missing_and_extra_tensors(saved):
    header, data = read_file(saved)
    header["bias"] = header.pop("v_scales")
    write_file(saved, header, data)
    with pytest.raises(SnapshotError, match=r"missing \['v_scales'\], unexpected \['bias'\]"):
        load_snapshot(saved)


@pytest.mark.parametrize("verify, algo, width", [(True, "xxh3_128", 32), ("sha256", "sha256", 64),
                                                 (False, None, None)])
def test_load_checks_data_digests(saved, verify, algo, width):
    raw = bytearray(saved.read_bytes())
    raw[-3] ^= 0x10  # a byte of v_codes
    saved.write_bytes(bytes(raw))
    if verify:
        with pytest.raises(SnapshotError, match=rf"the bytes of v_codes do not match their "
                                                rf"{algo} \(header [0-9a-f]{{{width}}}, data"):
            load_snapshot(saved, verify=verify)
    else:  # the data pass is skipped; the header is still checked
        assert load_snapshot(saved, verify=False).v_codes.reshape(-1)[-3] != 0
    with pytest.raises(SnapshotError, match=r"verify must be True, False or 'sha256', got 'md5'"):
        load_snapshot(saved, verify="md5")


def test_version_1_files_load_with_their_sha256(rng, tmp_path):
    # version 1 (kvcore before the XXH3 digests): SHA-256 per tensor only
    snap = random_snapshot("int8", rng)
    path = tmp_path / "v1.safetensors"
    snap.save(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header["__metadata__"]
    for key in [k for k in meta if k.startswith("xxh3_128_")]:
        del meta[key]
    meta["file_version"] = "1"
    meta["sha256"] = _metadata_digest(meta)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))  # same length: the data stays where it was
    path.write_bytes(raw[:8] + text + raw[8 + n:])
    assert_same_snapshot(load_snapshot(path), snap)
    corrupt = bytearray(path.read_bytes())
    corrupt[-1] ^= 1
    path.write_bytes(bytes(corrupt))
    with pytest.raises(SnapshotError, match=r"do not match their sha256"):
        load_snapshot(path)


def test_load_refuses_truncated_and_extended_files(saved):
    raw = saved.read_bytes()
    for cut, match in [(0, "0 bytes is too short"), (7, "7 bytes is too short"),
                       (100, r"header length \d+ exceeds the 92 bytes after the length field"),
                       (len(raw) - 1, "data section is 2159 bytes but the metadata describes 2160")]:
        saved.write_bytes(raw[:cut])
        with pytest.raises(SnapshotError, match=match):
            load_snapshot(saved)
    saved.write_bytes(raw + b"\0")
    with pytest.raises(SnapshotError, match="data section is 2161 bytes"):
        load_snapshot(saved)


def test_load_refuses_garbage_headers(tmp_path):
    path = tmp_path / "x"
    cases = [
        (struct.pack("<Q", 2**64 - 1) + b"{}", "header length 18446744073709551615 exceeds"),
        (struct.pack("<Q", 2**25) + b" " * 2**25, "exceeds the limit of 16777216 bytes"),
        (struct.pack("<Q", 4) + b"\xff\xfe{}", "header is not valid JSON: UnicodeDecodeError"),
        (struct.pack("<Q", 3) + b"{x}", "header is not valid JSON: JSONDecodeError"),
        (struct.pack("<Q", 200000) + b"[" * 200000, "header is not valid JSON: RecursionError"),
        (struct.pack("<Q", 2) + b"[]", "header must be a JSON object, got list"),
        (struct.pack("<Q", 2) + b"{}", "no __metadata__ of strings: not a kvcore snapshot"),
        (struct.pack("<Q", 29) + b'{"__metadata__":{"a":"b"}}   ',
         "metadata has no file_version: not a kvcore snapshot"),
    ]
    for raw, match in cases:
        path.write_bytes(raw)
        with pytest.raises(SnapshotError, match=match):
            load_snapshot(path)


def test_load_names_the_file(saved):
    saved.write_bytes(b"1234")
    with pytest.raises(SnapshotError, match=f"snapshot file '{saved}'"):
        load_snapshot(saved)


# ------------------------------------------------------------------ prefix reuse

PROMPT, PREFIX, DECODE = 9, 6, 4


def append_range(cache, k, v, start, stop):
    for layer in range(cache.spec.num_layers):
        cache.append(layer, k[layer, start:stop], v[layer, start:stop])
    cache.advance()


def decode(cache, k, v, q):
    """DECODE one-position steps after the prompt: append each layer's K/V, attend with
    that step's queries (GQA), advance; returns the attention outputs [DECODE, L, Hq, D]."""
    outs = []
    for step, pos in enumerate(range(PROMPT, PROMPT + DECODE)):
        for layer in range(cache.spec.num_layers):
            cache.append(layer, k[layer, pos], v[layer, pos])
        outs.append([kvcore.decode_attention(q[step, layer], cache, layer)
                     for layer in range(cache.spec.num_layers)])
        cache.advance()
    return np.array(outs)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("through_file", [False, True])
def test_prefix_reuse_is_bit_identical(fmt, through_file, rng, tmp_path):
    """A prefix restored from a snapshot and decoded on gives the codes, scales and
    attention outputs of a cache that prefilled the whole prompt itself."""
    spec = small_spec(fmt, capacity=16, num_heads=4)
    shape = (spec.num_layers, PROMPT + DECODE, spec.num_kv_heads, spec.head_dim)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((DECODE, spec.num_layers, spec.num_heads, spec.head_dim),
                            dtype=np.float32)
    whole = KVCache(spec)
    append_range(whole, k, v, 0, PROMPT)
    expected = decode(whole, k, v, q)

    prefix = KVCache(spec)
    append_range(prefix, k, v, 0, PREFIX)
    snap = prefix.snapshot()
    if through_file:
        snap.save(tmp_path / "prefix.safetensors")
        snap = load_snapshot(tmp_path / "prefix.safetensors")
    reused = KVCache(spec)
    reused.restore(snap)
    append_range(reused, k, v, PREFIX, PROMPT)
    got = decode(reused, k, v, q)

    assert reused.length == whole.length == PROMPT + DECODE
    assert got.tobytes() == expected.tobytes()
    assert reused._storage.tobytes() == whole._storage.tobytes()
    for layer in range(spec.num_layers):
        for which in "kv":
            assert np.array_equal(reused.dequantize(layer, which), whole.dequantize(layer, which))


# ---------------------------------------------------------------- windowed sequences

def windowed(rng, fmt="int8", n=23, window=6, sinks=2, ps=4, pages=12, capacity=40):
    """A windowed KVPool and a sequence of n positions decoded one step at a time."""
    spec = small_spec(fmt, capacity=capacity)
    pool = kvcore.KVPool(spec, num_pages=pages, page_size=ps, window=window, sink_tokens=sinks)
    s = pool.new_sequence()
    for _ in range(n):
        for layer in range(spec.num_layers):
            k, v = (rng.standard_normal((1, 2, 32)).astype(np.float32) for _ in range(2))
            pool.append(k, v, seq=s, layer=layer)
        pool.advance(s)
    return pool, s


def assert_pool_holds(pool, s, other, t):
    """Sequences s of pool and t of other hold the same positions, byte for byte."""
    assert pool.length(s) == other.length(t) and pool.held(s) == other.held(t)
    for layer in range(pool.spec.num_layers):
        for x, y in zip(pool._gather(s, layer), other._gather(t, layer)):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("fmt", ["f16", "int8", "q8_0"])
def test_windowed_snapshot_holds_what_the_sequence_holds(fmt, rng, tmp_path):
    """A windowed sequence's snapshot holds positions [0, sink_end) and [start, length),
    says so (file version 3, start and sink_end in the metadata), and restores into a
    windowed pool as a sequence holding the same positions, byte for byte (so its
    attention is the same); a snapshot of all positions is still a version 2 file."""
    pool, s = windowed(rng, fmt)
    snap = pool.snapshot(s)
    assert (snap.length, snap.start, snap.sink_end, snap.held) == (23, 16, 4, 11)
    assert snap.k_codes.shape == (3, 11, 2, 32)
    rows = pool._gather(s, 1)
    assert snap.k_codes[1].tobytes() == rows[0].tobytes()
    path = tmp_path / "w.safetensors"
    snap.save(path)
    meta = read_file(path)[0]["__metadata__"]
    assert (meta["file_version"], meta["start"], meta["sink_end"]) == ("3", "16", "4")
    with safe_open(str(path), framework="numpy") as f:
        assert f.get_tensor("k_codes").shape == (3, 11, 2, 32)
    loaded = load_snapshot(path)
    assert (loaded.start, loaded.sink_end) == (16, 4)
    assert_same_snapshot(loaded, snap)
    for source in (snap, loaded):
        t = pool.restore(source)
        assert_pool_holds(pool, s, pool, t)
        assert pool.page_table(t).tolist()[1:4] == [-1, -1, -1]
        pool.free(t)
    # into an existing sequence, and into another pool of the same window
    u = pool.new_sequence()
    assert pool.restore(snap, seq=u) == u
    assert_pool_holds(pool, s, pool, u)
    other = kvcore.KVPool(pool.spec, num_pages=3, page_size=4, window=6, sink_tokens=2)
    assert_pool_holds(pool, s, other, other.restore(snap))
    assert other.num_free_pages == 0             # 1 sink page + 2 of the window
    # a snapshot of every position is still a version 2 file
    pool.truncate(s, 21)
    with pytest.raises(kvcore.StateError, match="only to n >= 21"):
        pool.snapshot(s, 20)
    full = pool.snapshot(s, 3)                   # within the sink page: all of [0, 3)
    assert (full.start, full.sink_end, full.length) == (0, 0, 3)
    full.save(path)
    assert "start" not in read_file(path)[0]["__metadata__"]
    assert read_file(path)[0]["__metadata__"]["file_version"] == "2"


def test_windowed_snapshot_restores_only_where_the_window_is_held(rng):
    """A snapshot with start > 0 is refused (SnapshotError, nothing changed) by a
    KVCache, a pool without a window, a pool whose window or sink positions need
    positions it lacks, or whose pages its positions do not fall on; a snapshot of all
    positions restores into a windowed pool, which keeps only what its window needs."""
    pool, s = windowed(rng, "f16", n=30, window=5, sinks=0, pages=10)
    snap = pool.snapshot(s)
    assert (snap.start, snap.sink_end) == (24, 0)
    cache = KVCache(pool.spec)
    before = cache._storage.tobytes()
    with pytest.raises(SnapshotError, match=r"holds positions \[0, 0\) and \[24, 30\) of a "
                                            r"windowed KVPool's sequence.*only a KVPool with a "
                                            r"window"):
        cache.restore(snap)
    assert cache._storage.tobytes() == before and cache.length == 0
    for kw, match in ((dict(), "only a KVPool with a window"),
                      (dict(window=8), r"this pool's window 8 needs positions from 23"),
                      (dict(window=5, sink_tokens=1), r"keeps its sink pages, positions \[0, 4\)"),
                      (dict(window=5, page_size=16), "does not start a page of this pool")):
        kw.setdefault("page_size", 4)
        other = kvcore.KVPool(pool.spec, num_pages=6, **kw)
        with pytest.raises(SnapshotError, match=match):
            other.restore(snap)
        assert other.num_free_pages == 6 and not other.sequences
    # a smaller window needs a subset: it holds fewer pages
    small = kvcore.KVPool(pool.spec, num_pages=6, page_size=4, window=2)
    t = small.restore(snap)
    assert small.held(t) == [(28, 30)] and small.num_free_pages == 5
    assert small.dequantize(t, 0, "k").tobytes() == pool.dequantize(s, 0, "k")[4:].tobytes()
    # another page size where the positions fall on its pages
    wide = kvcore.KVPool(pool.spec, num_pages=6, page_size=8, window=3)
    t = wide.restore(snap)
    assert wide.held(t) == [(24, 30)]
    assert wide.dequantize(t, 2, "v").tobytes() == pool.dequantize(s, 2, "v").tobytes()
    # a snapshot of every position: the pool keeps the window's pages only (6 pages of 4
    # could not hold 30 positions)
    full = filled_cache("f16", rng, n=30, capacity=40).snapshot()
    tight = kvcore.KVPool(pool.spec, num_pages=3, page_size=4, window=5, sink_tokens=2)
    t = tight.restore(full)
    assert tight.held(t) == [(0, 4), (24, 30)] and tight.num_free_pages == 0
    for layer in range(3):
        k = kvcore.dequantize(full.k_codes[layer], None, "f16")
        assert tight.dequantize(t, layer, "k").tobytes() == \
            np.concatenate([k[:4], k[24:]]).tobytes()
    assert tight.snapshot(t).held == 10
    # requantized, the snapshot keeps what it holds
    q = kvcore.KVPool(small_spec("int8", capacity=40), num_pages=4, page_size=4, window=5)
    t = q.restore(snap, requantize=True)
    assert q.held(t) == [(24, 30)] and q.snapshot(t).start == 24


def test_snapshot_start_and_sink_end_are_checked(rng):
    snap = random_snapshot("f16", rng, length=5)
    parts = {name: getattr(snap, name) for name in PARTS}
    with pytest.raises(DTypeError, match="invalid type of start: expected int, got float"):
        Snapshot(snap.spec, 9, **parts, start=4.0)
    for start, sink_end in ((4, 4), (10, 0), (3, 5), (0, 2)):
        with pytest.raises(SnapshotError, match=f"start {start} and sink_end {sink_end} out of "
                                                f"range: expected 0 <= sink_end < start <= "
                                                f"length 9, or both 0"):
            Snapshot(snap.spec, 9, **parts, start=start, sink_end=sink_end)
    with pytest.raises(SnapshotError, match=r"snapshot k_codes: expected \[3, 6, 2, 32\] float16, "
                                            r"got \[3, 5, 2, 32\]"):
        Snapshot(snap.spec, 9, **parts, start=3)       # holds 9 - 3 = 6 positions, not 5
    s = Snapshot(snap.spec, 9, **parts, start=5, sink_end=1)
    assert (s.start, s.sink_end, s.held, s.length) == (5, 1, 5, 9)


@pytest.mark.parametrize("start, sink_end, match", [
    ("14", "4", r"metadata start 14 and sink_end 4 out of range"),
    ("2", "4", r"metadata start 2 and sink_end 4 out of range"),
    ("x", "4", r"metadata start must be a non-negative decimal integer")])
def test_version_3_metadata_is_checked(rng, tmp_path, start, sink_end, match):
    pool, s = windowed(rng, "int8", n=13, window=3, sinks=1)
    path = tmp_path / "w.safetensors"
    pool.snapshot(s).save(path)
    header, data = read_file(path)
    assert (header["__metadata__"]["start"], header["__metadata__"]["sink_end"]) == ("8", "4")
    header["__metadata__"].update(start=start, sink_end=sink_end)
    write_file(path, header, data)
    with pytest.raises(SnapshotError, match=match):
        load_snapshot(path)
    header["__metadata__"]["file_version"] = "2"          # version 2 has no start
    header["__metadata__"].update(start="4", sink_end="4")
    write_file(path, header, data)
    with pytest.raises(SnapshotError, match=r"unexpected \['sink_end', 'start'\]"):
        load_snapshot(path)


# ------------------------------------------------------------------- K/V pairs

def test_pair_snapshot_says_both_formats_and_refuses_another_pair(rng, tmp_path):
    """A K q8_0 / V q4_0 snapshot's file names both formats (metadata format
    "q8_0/q4_0", each side's tensors in its dtype); a cache of another pair, or of one
    format, refuses it naming both sides of both (nothing changed) unless requantize."""
    snap = filled_cache("q8_0/q4_0", rng, 5).snapshot()
    assert snap.k_codes.dtype == np.int8 and snap.v_codes.shape[-1] == 16   # D 32: 16 bytes
    path = tmp_path / "pair.safetensors"
    snap.save(path)
    with safe_open(path, "np") as f:
        assert f.metadata()["format"] == "q8_0/q4_0"
        assert f.get_tensor("v_codes").dtype == np.uint8
    loaded = load_snapshot(path)
    assert_same_snapshot(loaded, snap)
    for other, shown in (("q4_0/q8_0", "K q4_0 / V q8_0"), ("q8_0", "K q8_0 / V q8_0"),
                         ("q8_0/f16", "K q8_0 / V f16")):
        cache = filled_cache(other, rng, 2)
        before = cache._storage.tobytes()
        with pytest.raises(SnapshotError, match=f"snapshot formats K q8_0 / V q4_0 do not "
                                                f"match the cache's {shown} \\(pass "
                                                f"requantize=True"):
            cache.restore(loaded)
        assert cache._storage.tobytes() == before and cache.length == 2
    back = KVCache(small_spec("q8_0/q4_0"))
    back.restore(loaded)
    assert_cache_holds(back, snap)


def test_pair_snapshot_parts_follow_each_side(rng):
    """A pair's Snapshot checks each side's parts against its own format."""
    snap = random_snapshot("f16/q4_0", rng)
    assert snap.k_scales is None and snap.v_scales.dtype == np.float16
    with pytest.raises(SnapshotError, match="snapshot of K format f16 has no scales, got k_scales"):
        Snapshot(snap.spec, snap.length, snap.k_codes, snap.v_codes, snap.v_scales, snap.v_scales)
    with pytest.raises(SnapshotError, match=r"snapshot v_codes: expected \[3, 5, 2, 16\] uint8"):
        Snapshot(snap.spec, snap.length, snap.k_codes, snap.k_codes, None, snap.v_scales)
