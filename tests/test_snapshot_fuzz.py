"""Fuzzing load_snapshot: every mutated file either loads with exactly the original
content or raises SnapshotError; never another exception, never a crash.

Iterations: KVCORE_FUZZ_ITERATIONS (default 300, the CI budget); e.g.
KVCORE_FUZZ_ITERATIONS=20000 pytest tests/test_snapshot_fuzz.py for a long run.
"""
import json
import os
import struct

import numpy as np
import pytest

import kvcore
from kvcore import KVSpec, Snapshot, SnapshotError, load_snapshot
from kvcore.formats import ROW_FORMATS as FORMATS   # K and V in one format (q4_1ch is K only)
from kvcore.snapshot import _metadata_digest

ITERATIONS = int(os.environ.get("KVCORE_FUZZ_ITERATIONS", "300"))
PARTS = ("k_codes", "v_codes", "k_scales", "v_scales")


def make_snapshot(fmt, rng):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, capacity=6, format=fmt)
    shape = (2, 4, 2, 32)
    parts = {}
    for which in "kv":
        codes, scales = kvcore.quantize(rng.standard_normal(shape).astype(np.float32), fmt)
        parts[f"{which}_codes"] = codes.view(spec.fmt.code_dtype)
        if scales is not None:
            parts[f"{which}_scales"] = scales
    return Snapshot(spec, 4, **parts)


def split(raw):
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header, data, *, resign):
    if resign and isinstance(header.get("__metadata__"), dict):
        meta = header["__metadata__"]
        if all(isinstance(v, str) for v in meta.values()):
            meta["sha256"] = _metadata_digest(meta)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


LIES = [0, 1, -1, 2**31, 2**63, 2**64 + 5, 10**30, 1.5, True, None, "3", [], {}, [1, 2]]


def lie_about_header(raw, rng):
    """Rewrites one header field with a plausible or absurd value (re-signing the
    metadata half the time, so the checks past the metadata digest are reached)."""
    header, data = split(raw)
    names = [k for k in header if k != "__metadata__"]
    choice = rng.integers(6)
    resign = bool(rng.integers(2))
    if choice == 0:  # a metadata value
        meta = header["__metadata__"]
        # A re-signed capacity, num_heads or kvcore_version is a valid file of another
        # spec, not a lie: those three are only changed unsigned.
        keys = sorted(set(meta) - ({"capacity", "num_heads", "kvcore_version"} if resign else set()))
        key = rng.choice(keys)
        meta[key] = str(rng.choice([0, 1, 3, 4, 5, 7, 32, 2**40, 10**19, -1, "int8", "f16",
                                    "q8_0", "x", ""]))
    elif choice == 1:  # a dtype
        header[rng.choice(names)]["dtype"] = str(rng.choice(["I8", "U8", "F16", "F32", "U16",
                                                             "BF16", "F64", "I64", "BOOL", "X"]))
    elif choice == 2:  # one shape entry
        shape = header[rng.choice(names)]["shape"]
        shape[rng.integers(len(shape))] = LIES[rng.integers(len(LIES))]
    elif choice == 3:  # one offset
        span = header[rng.choice(names)]["data_offsets"]
        span[rng.integers(2)] = LIES[rng.integers(len(LIES))]
    elif choice == 4:  # swap two tensors' offsets
        a, b = rng.choice(names, 2, replace=False)
        header[a]["data_offsets"], header[b]["data_offsets"] = (header[b]["data_offsets"],
                                                                header[a]["data_offsets"])
    else:  # drop or add a key
        if rng.integers(2):
            del header[rng.choice(names + ["__metadata__"])]
        else:
            header["extra"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    return join(header, data, resign=resign)


def mutate(raw: bytes, rng) -> bytes:
    kind = rng.integers(7)
    if kind == 0:  # flip bits in 1..8 random bytes
        out = bytearray(raw)
        for i in rng.integers(len(raw), size=rng.integers(1, 9)):
            out[i] ^= int(rng.integers(1, 256))
        return bytes(out)
    if kind == 1:  # truncate
        return raw[:rng.integers(len(raw))]
    if kind == 2:  # extend
        return raw + rng.bytes(int(rng.integers(1, 64)))
    if kind == 3:
        return lie_about_header(raw, rng)
    if kind == 4:  # a random header length field
        return struct.pack("<Q", int(rng.integers(2**63)) >> int(rng.integers(64))) + raw[8:]
    if kind == 5:  # random bytes
        return rng.bytes(int(rng.integers(0, 2 * len(raw))))
    # a byte range overwritten with random bytes
    start = int(rng.integers(len(raw)))
    stop = min(len(raw), start + int(rng.integers(1, 32)))
    return raw[:start] + rng.bytes(stop - start) + raw[stop:]


def same(a: Snapshot, b: Snapshot) -> bool:
    if a.spec != b.spec or a.length != b.length:
        return False
    for name in PARTS:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and (
                x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes())):
            return False
    return True


def test_fuzzed_files_load_exactly_or_raise_snapshot_error(tmp_path):
    rng = np.random.default_rng(20261122)
    originals = {}
    for fmt in FORMATS:
        snap = make_snapshot(fmt, rng)
        snap.save(tmp_path / f"{fmt}.safetensors")
        originals[fmt] = (snap, (tmp_path / f"{fmt}.safetensors").read_bytes())
    path = tmp_path / "mutant.safetensors"
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(ITERATIONS):
        fmt = list(FORMATS)[i % len(FORMATS)]
        snap, raw = originals[fmt]
        mutant = mutate(raw, rng)
        path.write_bytes(mutant)
        try:
            loaded = load_snapshot(path)
        except SnapshotError:
            outcomes["refused"] += 1
            continue
        except Exception as e:  # any other type is a bug: report the file that caused it
            pytest.fail(f"iteration {i} ({fmt}): {type(e).__name__}: {e}; "
                        f"file {mutant[:200]!r}...")
        assert same(loaded, snap), f"iteration {i} ({fmt}) loaded different content"
        outcomes["loaded"] += 1
    assert outcomes["refused"] > ITERATIONS // 2, outcomes
