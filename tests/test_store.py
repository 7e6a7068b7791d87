"""The chunk store: content keys, the chunk codec and its refusals, the directory
backend, Redis (a single server and a three-master cluster, real servers started by the
fixtures in conftest.py), two processes sharing a prefix, a server killed mid-run, and
eviction by the server."""
import hashlib
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvcore
from kvcore import KVCache, KVSpec
from kvcore._prefix_keys import ROOT, encode_extra, prefix_keys, token_array
from kvcore.errors import ChunkError, DTypeError, RangeError, SnapshotError, StoreError
from kvcore.store import (DirectoryBackend, KVStore, RedisBackend, StoreWriter, decode_chunk,
                          encode_chunk)
from kvcore.store._codec import MAGIC, ChunkKind

from _formats import PAIRS
from _toy_model import decode, prefill

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT_DIR = os.path.dirname(TESTS)
C = 16  # chunk tokens in most tests


def spec_of(fmt="int8", **kw):
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=32, capacity=256, num_heads=4,
                  format=fmt)
    fields.update(kw)
    return KVSpec(**fields)


def computed(spec, tokens):
    cache = KVCache(spec)
    prefill(cache, tokens)
    return cache


def same_positions(a, b, n):
    """Codes and scales of positions [0, n) equal byte for byte in every layer."""
    for layer in range(a.spec.num_layers):
        for x, y in zip(a._layer_arrays(layer), b._layer_arrays(layer)):
            if x is not None and not np.array_equal(x[:n].view(np.uint8), y[:n].view(np.uint8)):
                return False
    return True


# ------------------------------------------------------------------ content keys

def _reference_key(parent, ids, extra):
    """The documented encoding, written out independently of kvcore._prefix_keys."""
    body = b"kvcore-prefix-v1" + parent + struct.pack("<Q", len(ids))
    body += b"".join(struct.pack("<q", int(t)) for t in ids)
    body += struct.pack("<I", len(extra))
    for kind in sorted(extra):
        value = extra[kind]
        tagged = (b"s" + value.encode()) if isinstance(value, str) else (b"b" + value)
        body += struct.pack("<I", len(kind)) + kind.encode() + struct.pack("<I", len(tagged)) + tagged
    return hashlib.sha256(body).digest()


def test_prefix_keys_follow_the_documented_encoding(rng):
    tokens = rng.integers(0, 2**40, 3 * C + 5)
    extra = {"salt": "tenant-7", "adapter": b"\x00lora"}
    keys = prefix_keys(tokens, C, extra)
    assert len(keys) == 3  # the partial block has no key
    parent = ROOT
    for i, key in enumerate(keys):
        parent = _reference_key(parent, tokens[i * C:(i + 1) * C], extra)
        assert key == parent


def test_prefix_keys_tag_extras_by_kind_and_chain_the_prefix(rng):
    tokens = rng.integers(0, 50000, 2 * C)
    base = prefix_keys(tokens, C)
    assert prefix_keys(tokens, C, {"adapter": "x"}) != prefix_keys(tokens, C, {"salt": "x"})
    assert prefix_keys(tokens, C, {"salt": "x"}) != prefix_keys(tokens, C, {"salt": b"x"})
    assert prefix_keys(tokens, C, {"a": "1", "b": "2"}) == prefix_keys(tokens, C, {"b": "2", "a": "1"})
    assert prefix_keys(tokens, C, {}) == base == prefix_keys(list(tokens), C)
    other = tokens.copy()
    other[0] += 1  # a change in the first block changes every later key
    assert all(a != b for a, b in zip(prefix_keys(other, C), base))
    assert prefix_keys(tokens.astype(np.int32), C) == base


def test_prefix_keys_are_the_same_in_another_process(rng):
    tokens = rng.integers(0, 50000, 3 * C)
    code = ("import sys, numpy as np; from kvcore._prefix_keys import prefix_keys; "
            f"print(' '.join(k.hex() for k in prefix_keys(np.array({tokens.tolist()}), {C}, "
            "{'salt': 's'})))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT_DIR, env=env, check=True).stdout.split()
    assert out == [k.hex() for k in prefix_keys(tokens, C, {"salt": "s"})]


def test_token_ids_and_extras_are_checked():
    with pytest.raises(RangeError, match=r"tokens\[1\] = -3"):
        token_array([1, -3])
    with pytest.raises(DTypeError, match="1-D integer array"):
        token_array(np.zeros(3, np.float32))
    with pytest.raises(DTypeError, match="expected ints"):
        token_array([1, "a"])
    with pytest.raises(DTypeError, match="expected str or bytes"):
        encode_extra({"salt": 3})
    with pytest.raises(RangeError, match="block"):
        prefix_keys([1, 2], 0)


# ------------------------------------------------------------------ the chunk codec

def _chunk(spec, rng, key="k0"):
    """(kind, key, token ids, parts, value) of one chunk of C computed positions."""
    tokens = rng.integers(0, 50000, C)
    snap = computed(spec, tokens).snapshot()
    parts = {n: getattr(snap, n) for n in ("k_codes", "v_codes", "k_scales", "v_scales")
             if getattr(snap, n) is not None}
    kind = ChunkKind("org/model@rev", spec, C)
    return kind, key, tokens, parts, encode_chunk(kind, key, tokens, parts)


@pytest.mark.parametrize("fmt", list(kvcore.formats.ROW_FORMATS) + PAIRS)
def test_chunk_round_trip_every_format(fmt, rng):
    kind, key, tokens, parts, value = _chunk(spec_of(fmt), rng)
    assert value[:8] == MAGIC
    got = decode_chunk(kind, key, tokens, value)
    assert sorted(got) == sorted(parts)
    for name, arr in parts.items():
        assert got[name].dtype == arr.dtype and np.array_equal(got[name].view(np.uint8),
                                                                arr.view(np.uint8))
        assert not got[name].flags.writeable
    # the same value from arrays of any layout: a slice of positions of a longer snapshot
    # (one piece per layer), and Fortran order (copied)
    wide = {n: np.concatenate([a, a], axis=1) for n, a in parts.items()}
    assert encode_chunk(kind, key, tokens, {n: a[:, C:] for n, a in wide.items()}) == value
    assert encode_chunk(kind, key, tokens, {n: np.asfortranarray(a)
                                            for n, a in parts.items()}) == value
    # the body is a safetensors blob: the safetensors library reads it as written
    from safetensors.numpy import load
    blob = load(value[24:])
    assert np.array_equal(blob["token_ids"], tokens)
    for name, arr in parts.items():
        assert np.array_equal(blob[name].view(np.uint8), arr.view(np.uint8))


def test_every_flipped_bit_and_truncation_is_refused(rng):
    kind, key, tokens, _, value = _chunk(spec_of("int8", num_layers=1, head_dim=32), rng)
    body = bytearray(value)
    header_end = 24 + 8 + struct.unpack("<Q", value[24:32])[0]
    # every byte of the prefix and the header, and spread bytes of the data
    places = list(range(header_end)) + list(range(header_end, len(value), 7))
    for i in places:
        for bit in (0, 5):
            body[i] ^= 1 << bit
            with pytest.raises(ChunkError):
                decode_chunk(kind, key, tokens, bytes(body))
            body[i] ^= 1 << bit
    for n in (0, 7, 24, 31, header_end - 1, header_end, len(value) - 1):
        with pytest.raises(ChunkError, match="too short|XXH3|truncated"):
            decode_chunk(kind, key, tokens, value[:n])
    with pytest.raises(ChunkError, match="XXH3"):
        decode_chunk(kind, key, tokens, value + b"\0")
    decode_chunk(kind, key, tokens, bytes(body))  # restored: accepted again


def test_foreign_and_mismatched_values_are_refused(rng, tmp_path):
    spec = spec_of("int8")
    kind, key, tokens, parts, value = _chunk(spec, rng)
    refusals = {
        "not a kvcore chunk": (kind, key, tokens, b"GARBAGE!" + value[8:]),
        "version b'2'": (kind, key, tokens, MAGIC[:-1] + b"2" + value[8:]),
        "format 'int8' \\(expected 'fp8_e4m3'\\)": (
            ChunkKind(kind.model, spec.replace(format="fp8_e4m3"), C), key, tokens, value),
        "num_kv_heads '2' \\(expected '4'\\)": (
            ChunkKind(kind.model, spec.replace(num_kv_heads=4), C), key, tokens, value),
        "head_dim '32' \\(expected '64'\\)": (
            ChunkKind(kind.model, spec.replace(head_dim=64), C), key, tokens, value),
        "model 'org/model@rev' \\(expected 'org/model@other'\\)": (
            ChunkKind("org/model@other", spec, C), key, tokens, value),
        "chunk_tokens '16' \\(expected '32'\\)": (ChunkKind(kind.model, spec, 2 * C), key,
                                                 np.concatenate([tokens, tokens]), value),
        "written under key 'k0'": (kind, "k1", tokens, value),
        "other tokens \\(position 3": (kind, key, np.where(np.arange(C) == 3, tokens + 1, tokens),
                                        value),
    }
    for reason, args in refusals.items():
        with pytest.raises(ChunkError, match=reason):
            decode_chunk(*args)
    # a snapshot file is a safetensors blob, but no chunk
    snap = computed(spec, tokens).snapshot()
    snap.save(tmp_path / "s.safetensors")
    with pytest.raises(ChunkError, match="not a kvcore chunk"):
        decode_chunk(kind, key, tokens, (tmp_path / "s.safetensors").read_bytes())
    # a well-formed value whose codes no encoder makes (int8 -128)
    bad = dict(parts, k_codes=parts["k_codes"].copy())
    bad["k_codes"][1, 2, 1, 5] = -128
    with pytest.raises(ChunkError, match=r"chunk values: snapshot k_codes\[1, 2, 1, 5\] = .*-128"):
        decode_chunk(kind, key, tokens, encode_chunk(kind, key, tokens, bad))


# ------------------------------------------------------------------ the store, on a directory

def test_directory_store_saves_whole_chunks_and_loads_the_longest_prefix(tmp_path, rng):
    spec = spec_of("q8_0")
    tokens = rng.integers(0, 50000, 3 * C + 5)
    source = computed(spec, tokens)
    store = KVStore(DirectoryBackend(tmp_path / "kv"), model="m@1", spec=spec, chunk_tokens=C)
    assert store.lookup(tokens) == 0
    assert store.load(tokens).positions == 0 and store.load(tokens).miss == "chunk 0 not stored"
    assert store.save(source.snapshot(), tokens) == 3  # the partial chunk is not saved
    assert store.save(source.snapshot(), tokens) == 0  # already stored
    files = [f for _, _, fs in os.walk(tmp_path / "kv") for f in fs]
    assert len(files) == 3 and not any(f.endswith(".tmp") for f in files)

    target = KVCache(spec)
    result = store.load_into(target, tokens)
    assert (result.positions, result.chunks, result.miss) == (3 * C, 3, None)
    assert target.length == 3 * C and same_positions(source, target, 3 * C)
    # at most len(tokens) - 1 positions: a prompt of exactly 3 chunks loads 2
    assert store.load(tokens[:3 * C]).positions == 2 * C
    assert store.lookup(tokens[:3 * C]) == 2 * C
    # another prompt sharing the first chunk only
    other = tokens.copy()
    other[C + 1] += 1
    result = store.load(other)
    assert (result.positions, result.miss) == (C, "chunk 1 not stored")
    # other extras, model or chunk size: nothing
    assert store.load(tokens, {"salt": "x"}).positions == 0
    assert KVStore(store.backend, model="m@2", spec=spec, chunk_tokens=C).load(tokens).positions == 0
    assert KVStore(store.backend, model="m@1", spec=spec, chunk_tokens=2 * C).lookup(tokens) == 0


def test_a_corrupt_file_is_a_reported_miss_and_is_replaced(tmp_path, rng):
    spec = spec_of("int8")
    tokens = rng.integers(0, 50000, 3 * C + 1)
    source = computed(spec, tokens)
    backend = DirectoryBackend(tmp_path)
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C)
    store.save(source.snapshot(), tokens)
    path = backend._path(store.keys(tokens)[1])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    target = KVCache(spec)
    result = store.load_into(target, tokens)
    assert result.positions == C and result.miss.startswith("chunk 1 refused: ")
    assert "XXH3-128" in result.miss
    assert same_positions(source, target, C)
    assert not os.path.exists(path)  # deleted: the next save writes it again
    assert store.save(source.snapshot(), tokens) == 2
    assert store.load(tokens).positions == 3 * C
    with open(path, "wb") as f:  # truncated
        f.write(bytes(data[:100]))
    assert store.load(tokens).positions == C


def test_a_bounded_directory_evicts_the_least_recently_used_last_chunks_first(tmp_path, rng):
    spec = spec_of("int8")
    a, b = (rng.integers(0, 50000, 4 * C + 1) for _ in range(2))
    scratch = KVStore(DirectoryBackend(tmp_path / "scratch"), model="m", spec=spec, chunk_tokens=C)
    scratch.save(computed(spec, a).snapshot(), a)
    size = max(len(v) for v in scratch.backend.get_prefix(scratch.keys(a)))  # one chunk's bytes
    backend = DirectoryBackend(tmp_path / "kv", fsync=False, max_bytes=6 * size + 100)
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C)
    store.save(computed(spec, a).snapshot(), a)
    assert store.load(a).positions == 4 * C  # a read: a's chunks are used last to first
    store.save(computed(spec, b).snapshot(), b)  # 8 chunks: the 3 least recently used go
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "kv") for f in fs]
    assert len(files) == 5 and sum(os.path.getsize(f) for f in files) <= backend.max_bytes
    result = store.load(a)
    assert (result.positions, result.miss) == (C, "chunk 1 not stored")  # a kept its first
    assert store.load(b).positions == 4 * C
    with pytest.raises(RangeError, match="max_bytes"):
        DirectoryBackend(tmp_path, max_bytes=0)


def test_store_refuses_bad_arguments(tmp_path, rng):
    spec = spec_of("int8")
    backend = DirectoryBackend(tmp_path)
    for model in ("", "has space", "x{tag}", "a" * 201, 3):
        with pytest.raises(DTypeError, match="invalid model"):
            KVStore(backend, model=model, spec=spec)
    with pytest.raises(DTypeError, match="invalid prefix 'a b'"):
        KVStore(backend, model="m", spec=spec, prefix="a b")
    with pytest.raises(RangeError, match="chunk_tokens"):
        KVStore(backend, model="m", spec=spec, chunk_tokens=0)
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C)
    other = computed(spec.replace(format="f16"), rng.integers(0, 9, C)).snapshot()
    with pytest.raises(SnapshotError, match="format f16 does not match the store's int8"):
        store.save(other, np.arange(C))


def test_directory_backend_reports_io_failures(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(StoreError, match=f"directory {blocker}.*: create failed"):
        DirectoryBackend(blocker)
    backend = DirectoryBackend(tmp_path / "d")
    key = "k"
    os.makedirs(os.path.dirname(backend._path(key)))
    os.makedirs(backend._path(key))  # a directory where the file should be
    with pytest.raises(StoreError, match="write of key 'k' failed"):
        backend.put_many([(key, b"v")])
    with pytest.raises(StoreError, match="read of key 'k' failed"):
        backend.get_prefix([key])


class _GatedBackend(DirectoryBackend):
    """A directory backend whose writes wait until `gate` is set (to fill a writer's queue)."""

    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.gate = threading.Event()

    def put_many(self, items):
        self.gate.wait(10)
        super().put_many(items)

    def put_prefix(self, items):
        self.gate.wait(10)
        super().put_prefix(items)


def test_writer_saves_off_the_caller_thread_drops_when_full_and_flushes_on_close(tmp_path, rng):
    spec = spec_of("int8")
    backend = _GatedBackend(tmp_path)
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C)
    prompts = [rng.integers(0, 50000, 2 * C) for _ in range(5)]
    snaps = [computed(spec, p).snapshot() for p in prompts]
    writer = StoreWriter(store, max_pending=2)
    accepted = [writer.submit(s, p) for s, p in zip(snaps, prompts)]
    # the thread holds one save at the gate, two wait in the queue, the rest are dropped
    assert accepted.count(False) == writer.stats.dropped >= 2
    backend.gate.set()
    writer.close()
    assert writer.stats.chunks_written == 2 * accepted.count(True)
    for ok, p in zip(accepted, prompts):
        assert store.lookup(np.append(p, 0)) == (2 * C if ok else 0)
    with pytest.raises(kvcore.StateError, match="closed"):
        writer.submit(snaps[0], prompts[0])
    with StoreWriter(store) as other:  # refused in the caller's thread, nothing queued
        with pytest.raises(DTypeError, match="expected Snapshot"):
            other.submit(prompts[0], prompts[0])
        with pytest.raises(DTypeError, match="extra 'salt'"):
            other.submit(snaps[0], prompts[0], {"salt": 1})
        assert other.stats.submitted == 0


# ------------------------------------------------------------------ refused targets, the writer's thread,
# fork, unreadable files, huge values, temporary files and orphans (a hostile test's findings)

def within(seconds, fn, *args):
    """fn(*args) on a daemon thread; its result, or the test fails when it has not
    returned within `seconds` (a hang becomes a failure, not a stuck run)."""
    box = {}

    def body():
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            box["error"] = e
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__qualname__', fn)} did not return within {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def value_files(root):
    """Paths of the value files under a directory backend's root (no temporary files)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.startswith(".")]


def temp_files(root):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]


def test_load_into_refuses_a_cache_of_another_spec_changing_nothing(tmp_path, rng):
    spec = spec_of("int8")
    tokens = rng.integers(0, 50000, 2 * C + 1)
    store = KVStore(DirectoryBackend(tmp_path), model="m", spec=spec, chunk_tokens=C)
    store.save(computed(spec, tokens).snapshot(), tokens)
    files = {p: open(p, "rb").read() for p in value_files(tmp_path)}
    for field, value in (("num_layers", 3), ("num_kv_heads", 4), ("head_dim", 64),
                         ("format", "f32"), ("format", "fp8_e4m3")):
        other = spec_of(**{field: value, "num_heads": 4})
        target = computed(other, rng.integers(0, 50000, 5))
        before = target._storage.tobytes(), target.length
        with pytest.raises(SnapshotError, match=rf"^load_into: the target's {field} {value} does "
                                                rf"not match the store's {getattr(spec, field)}"):
            store.load_into(target, tokens)
        assert (target._storage.tobytes(), target.length) == before
    assert {p: open(p, "rb").read() for p in value_files(tmp_path)} == files  # nothing deleted
    target = KVCache(spec.replace(capacity=512))  # another capacity is fine
    assert store.load_into(target, tokens).positions == 2 * C


class _MemoryBackend(kvcore.store.Backend):
    """Values in a dict; `hook(op, key)` runs before each read or write (a test's fault)."""

    name = "memory"

    def __init__(self, hook=lambda op, key: None):
        self.values, self.hook = {}, hook

    def get_prefix(self, keys):
        out = []
        for k in keys:
            if k not in self.values:
                break
            self.hook("get", k)
            out.append(self.values[k])
        return out

    def contains_prefix(self, keys):
        self.hook("contains", None)
        n = 0
        while n < len(keys) and keys[n] in self.values:
            n += 1
        return n

    def put_many(self, items):
        for k, v in items:
            self.hook("put", k)
            self.values[k] = v

    def delete(self, keys):
        for k in keys:
            self.values.pop(k, None)


def test_writer_counts_any_exception_and_goes_on(rng):
    spec = spec_of("int8")
    calls = []

    def hook(op, key):
        if op == "put":
            calls.append(key)
            if len(calls) == 1:
                raise MemoryError("no memory for the value")
    store = KVStore(_MemoryBackend(hook), model="m", spec=spec, chunk_tokens=C)
    prompts = [rng.integers(0, 50000, C + 1) for _ in range(2)]
    writer = StoreWriter(store)
    assert writer.submit(computed(spec, prompts[0]).snapshot(), prompts[0])
    left = within(10, writer.flush)
    assert writer.stats.failed == 1 and "MemoryError: no memory" in writer.stats.last_error
    assert left == 0 and writer._thread.is_alive()  # the thread survived the MemoryError
    assert writer.submit(computed(spec, prompts[1]).snapshot(), prompts[1])  # later saves happen
    assert within(10, writer.flush) == 0
    assert writer.stats.chunks_written == 1 and store.lookup(prompts[1]) == C
    assert within(10, writer.close) == 0


def _async_raise(thread, exc):
    import ctypes
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(exc))
    assert n == 1


def test_a_writer_whose_thread_ended_drops_saves_and_flush_close_return(rng):
    """A thread killed (an asynchronous SystemExit: no Exception, so the thread ends) is
    reported: counted, submit drops, flush and close return at once and say what was
    lost."""
    spec = spec_of("int8")
    inside = threading.Event()

    def hook(op, key):
        if op == "put":
            inside.set()
            while True:  # Python code, so that the asynchronous exception is delivered
                time.sleep(0.01)
    store = KVStore(_MemoryBackend(hook), model="m", spec=spec, chunk_tokens=C)
    prompts = [rng.integers(0, 50000, C + 1) for _ in range(3)]
    snaps = [computed(spec, p).snapshot() for p in prompts]
    writer = StoreWriter(store)
    thread = writer._thread
    assert writer.submit(snaps[0], prompts[0]) and inside.wait(10)
    assert writer.submit(snaps[1], prompts[1])  # queued behind the save in progress
    _async_raise(thread, SystemExit)
    thread.join(10)
    assert not thread.is_alive() and writer.stats.failed == 1
    assert "thread ended" in writer.stats.last_error and "SystemExit" in writer.stats.last_error
    t0 = time.monotonic()
    assert writer.flush(timeout=30) == 1  # at once: the queued save will never be done
    assert time.monotonic() - t0 < 5
    assert writer.submit(snaps[2], prompts[2]) is False and writer.stats.dropped == 1
    assert writer.close(timeout=30) == 1 and writer.stats.dropped == 2  # discarded, counted
    assert time.monotonic() - t0 < 5


def test_writer_flush_and_close_return_within_their_timeout(tmp_path, rng):
    spec = spec_of("int8")
    gate, inside = threading.Event(), threading.Event()

    def hook(op, key):
        if op == "put":
            inside.set()
            gate.wait(30)
    store = KVStore(_MemoryBackend(hook), model="m", spec=spec, chunk_tokens=C)
    prompts = [rng.integers(0, 50000, C + 1) for _ in range(2)]
    writer = StoreWriter(store)
    assert writer.submit(computed(spec, prompts[0]).snapshot(), prompts[0]) and inside.wait(10)
    assert writer.submit(computed(spec, prompts[1]).snapshot(), prompts[1])
    t0 = time.monotonic()
    assert writer.flush(timeout=0.2) == 2  # one in progress, one queued
    assert 0.2 <= time.monotonic() - t0 < 5
    assert writer.close(timeout=0.2) == 2  # the queued one discarded, the running one lost
    assert 0.4 <= time.monotonic() - t0 < 5 and writer.stats.dropped == 1
    gate.set()  # the save in progress finishes on its own, then the thread ends
    writer._thread.join(10)
    assert not writer._thread.is_alive() and writer.stats.chunks_written == 1
    assert store.lookup(prompts[0]) == C and store.lookup(prompts[1]) == 0
    assert writer.close() == 0  # idempotent
    for bad in (-1, float("nan"), None, "1"):
        with pytest.raises(RangeError, match="timeout"):
            StoreWriter(store).flush(timeout=bad)


def test_a_writer_made_before_fork_works_in_the_child(tmp_path, rng):
    spec = spec_of("int8")
    store = KVStore(DirectoryBackend(tmp_path, fsync=False), model="m", spec=spec, chunk_tokens=C)
    a, b, c = (rng.integers(0, 50000, 2 * C + 1) for _ in range(3))
    snaps = {id(p): computed(spec, p).snapshot() for p in (a, b, c)}
    writer = StoreWriter(store)
    assert writer.submit(snaps[id(a)], a)
    writer.flush()
    assert store.lookup(a) == 2 * C
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code, never return into pytest
        code = 1
        try:
            ok = writer.submit(snaps[id(b)], b)
            left = writer.flush()  # hung forever: the parent's thread is not in the child
            found = store.lookup(b)
            lost = writer.close()
            code = 0 if (ok, left, found, lost) == (True, 0, 2 * C, 0) else 2
            if code:
                print("child:", ok, left, found, lost, writer.stats, flush=True)
        except BaseException as e:  # noqa: BLE001
            print("child failed:", repr(e), flush=True)
            code = 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's writer hung (killed after 30 s)")
        time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.lookup(b) == 2 * C  # the child's save
    assert writer.submit(snaps[id(c)], c) and writer.flush(timeout=20) == 0  # the parent's goes on
    assert store.lookup(c) == 2 * C and writer.close() == 0


def test_a_fifo_or_a_symlink_at_a_value_is_a_refused_chunk_never_a_hang(tmp_path, rng):
    spec = spec_of("int8")
    tokens = rng.integers(0, 50000, 3 * C + 1)
    source = computed(spec, tokens)
    backend = DirectoryBackend(tmp_path / "kv")
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C)
    store.save(source.snapshot(), tokens)
    keys = store.keys(tokens)
    path = backend._path(keys[1])
    os.unlink(path)
    os.mkfifo(path)
    result = within(10, store.load, tokens)
    assert (result.positions, result.miss) == (C, "chunk 1 refused: the value's file is a FIFO, "
                                                  "not a regular file")
    assert not os.path.lexists(path)  # deleted: the next save writes it again
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.symlink(fifo, path)
    result = within(10, store.load, tokens)
    assert result.positions == C and "symbolic link" in result.miss
    assert not os.path.lexists(path) and os.path.exists(fifo)  # the link, not its target
    os.symlink(fifo, path)
    got = within(10, backend.get_prefix, keys)
    assert len(got) == 2 and got[1] == b"" and "symbolic link" in got[1].reason
    assert backend.contains_prefix(keys) == 1 and store.lookup(tokens) == C
    # a pool's lookup with the guard held: a counted fault, never a hang
    pool = kvcore.KVPool(spec, num_pages=40, page_size=16, prefix_cache=True, store=store)
    seq, n = within(10, pool.match_prefix, tokens)
    assert n == C and pool.stats.store_faults == 1
    assert "symbolic link" in pool.stats.last_store_fault
    os.mkfifo(path)
    assert store.save(source.snapshot(), tokens) == 2  # a save replaces what is no value
    target = KVCache(spec)
    assert within(10, store.load_into, target, tokens).positions == 3 * C
    assert same_positions(source, target, 3 * C)


def test_a_value_longer_than_any_chunk_is_refused_before_it_is_read(tmp_path, rng):
    spec = spec_of("int8")
    tokens = rng.integers(0, 50000, 3 * C + 1)
    backend = DirectoryBackend(tmp_path / "kv")
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C)
    store.save(computed(spec, tokens).snapshot(), tokens)
    path = backend._path(store.keys(tokens)[1])
    os.truncate(path, 1 << 40)  # a sparse 1 TiB file
    result = within(30, store.load, tokens)
    bound = store._kind.max_value_bytes
    assert os.path.getsize(backend._path(store.keys(tokens)[0])) < bound < (1 << 21)
    assert (result.positions, result.miss) == (
        C, f"chunk 1 refused: the value's file of {1 << 40} bytes is longer than any chunk of "
           f"this store can be ({bound} bytes)")
    assert not os.path.exists(path)
    pool = kvcore.KVPool(spec, num_pages=40, page_size=16, prefix_cache=True, store=store)
    store.save(computed(spec, tokens).snapshot(), tokens)
    os.truncate(path, 1 << 40)
    assert within(30, pool.match_prefix, tokens)[1] == C and pool.stats.store_faults == 1
    # any backend: the codec refuses a value longer than the bound too
    kind = store._kind
    with pytest.raises(ChunkError, match=rf"value of {bound + 1} bytes is longer than any chunk"):
        decode_chunk(kind, "k", tokens[:C], bytes(bound + 1))


def test_every_failure_of_a_lookup_is_a_miss_or_a_store_error(tmp_path, rng, monkeypatch):
    spec = spec_of("int8")
    tokens = rng.integers(0, 50000, 3 * C + 1)
    fault = {}

    def hook(op, key):
        if op in fault:
            raise fault[op]
    backend = _MemoryBackend(hook)
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C, page_size=16)
    store.save(computed(spec, tokens).snapshot(), tokens)
    fault["get"] = RuntimeError("a bug in the backend")
    with pytest.raises(StoreError, match=r"^memory: read of 3 keys failed: RuntimeError: a bug"):
        store.load(tokens)
    fault["contains"] = ValueError("bad")
    with pytest.raises(StoreError, match=r"^memory: lookup of 3 keys failed: ValueError: bad"):
        store.lookup(tokens)
    del fault["contains"]
    pool = kvcore.KVPool(spec, num_pages=40, page_size=16, prefix_cache=True, store=store)
    seq, n = pool.match_prefix(tokens)  # never raises for the store
    assert n == 0 and pool.stats.store_faults == 1
    assert "RuntimeError: a bug" in pool.stats.last_store_fault
    del fault["get"]
    # the codec failing otherwise than by ChunkError: a refused chunk, the value kept
    from kvcore.store import _store
    real = _store.decode_chunk

    def decode(kind, key, ids, value):
        if key == store.keys(tokens)[1]:
            raise MemoryError("while checking")
        return real(kind, key, ids, value)
    monkeypatch.setattr(_store, "decode_chunk", decode)
    result = store.load(tokens)
    assert (result.positions, result.miss) == (C, "chunk 1 refused: MemoryError: while checking")
    assert len(backend.values) == 3


def test_temporary_files_count_toward_the_bound_and_stale_ones_are_swept(tmp_path, rng):
    spec = spec_of("int8")
    root = tmp_path / "kv"
    fan = root / "ab" / "cd"
    os.makedirs(fan)
    stale = fan / ".ab12.0123456789abcdef.tmp"  # a write killed partway, long ago
    stale.write_bytes(bytes(4_500_000))
    old = time.time_ns() - 7200 * 10**9  # two hours ago
    os.utime(stale, ns=(old, old))
    fresh = fan / ".cd34.fedcba9876543210.tmp"  # another process's write in progress
    fresh.write_bytes(bytes(300_000))
    backend = DirectoryBackend(root, fsync=False, max_bytes=1_000_000)
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C)
    prompts = [rng.integers(0, 50000, 8 * C + 1) for _ in range(12)]  # about 1 MB of values
    for p in prompts:
        store.save(computed(spec, p).snapshot(), p)
    assert not stale.exists() and fresh.exists() and DirectoryBackend.TEMP_MAX_AGE_S < 7200
    files = value_files(root) + temp_files(root)
    assert sum(os.path.getsize(f) for f in files) <= 1.1 * backend.max_bytes  # temps counted
    assert store.load(prompts[-1]).positions == 8 * C  # the newest prompt stayed
    # without max_bytes, the first write sweeps the stale temporary files too
    os.utime(fresh, ns=(old, old))
    unbounded = KVStore(DirectoryBackend(root, fsync=False), model="m", spec=spec, chunk_tokens=C)
    other = rng.integers(0, 50000, C + 1)
    assert unbounded.save(computed(spec, other).snapshot(), other) == 1
    assert temp_files(root) == []
    # a sweep in the middle of a save never deletes the temporary files the save holds
    eager = DirectoryBackend(tmp_path / "eager", fsync=False, max_bytes=20_000)
    eager.TEMP_MAX_AGE_S = -1  # every other temporary file is stale
    store = KVStore(eager, model="m", spec=spec, chunk_tokens=C)
    assert store.save(computed(spec, prompts[0]).snapshot(), prompts[0]) == 8  # swept 8 times
    assert store.load(prompts[0]).positions == 8 * C


def test_a_save_cut_short_leaves_no_chunk_without_its_head(tmp_path, rng, monkeypatch):
    """A save that fails or exits partway leaves no value that could never be hit (a
    tail whose head is missing): only temporary files, swept once stale."""
    from kvcore.store import _store
    spec = spec_of("int8")
    tokens = rng.integers(0, 50000, 6 * C + 1)
    backend = DirectoryBackend(tmp_path / "kv", fsync=False)
    store = KVStore(backend, model="m", spec=spec, chunk_tokens=C)
    real, calls = _store.encode_chunk, []

    def encode(*args):
        calls.append(1)
        if len(calls) == 4:
            raise MemoryError("cut short")
        return real(*args)
    monkeypatch.setattr(_store, "encode_chunk", encode)
    with pytest.raises(MemoryError):
        store.save(computed(spec, tokens).snapshot(), tokens)
    files = value_files(tmp_path / "kv")
    assert len(files) == store.lookup(tokens) // C  # every stored chunk can be hit
    assert temp_files(tmp_path / "kv") == []
    # a process that exits in the middle of a writer's save (no close)
    r = subprocess.run([sys.executable, "-c", f"""
import os, sys
sys.path.insert(0, {TESTS!r})
import numpy as np
from test_store import computed, spec_of, C
from kvcore.store import DirectoryBackend, KVStore, StoreWriter, _store
spec = spec_of("int8")
tokens = np.random.default_rng(5).integers(0, 50000, 6 * C + 1)
store = KVStore(DirectoryBackend({str(tmp_path / 'exit')!r}), model="m", spec=spec, chunk_tokens=C)
real, calls = _store.encode_chunk, []
def encode(*args):
    calls.append(1)
    if len(calls) == 5:
        os._exit(0)   # the interpreter goes away mid-save
    return real(*args)
_store.encode_chunk = encode
writer = StoreWriter(store)
writer.submit(computed(spec, tokens).snapshot(), tokens)
writer.flush()
os._exit(7)
"""], cwd=ROOT_DIR, timeout=120, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    exit_root = tmp_path / "exit"
    assert value_files(exit_root) == [] and len(temp_files(exit_root)) == 4
    old = time.time_ns() - 2 * DirectoryBackend.TEMP_MAX_AGE_S * 10**9
    for f in temp_files(exit_root):
        os.utime(f, ns=(old, old))
    assert DirectoryBackend(exit_root).sweep() > 0 and temp_files(exit_root) == []


# ------------------------------------------------------------------ Redis

def test_redis_single_server_round_trip_and_ttl(redis_server, rng):
    spec = spec_of("fp8_e4m3")
    tokens = rng.integers(0, 50000, 2 * C + 3)
    source = computed(spec, tokens)
    backend = RedisBackend(redis_server.url, ttl=60)
    store = KVStore(backend, model="redis-test", spec=spec, chunk_tokens=C)
    assert store.save(source.snapshot(), tokens) == 2
    keys = store.keys(tokens)
    assert all(0 < backend.client.pttl(k) <= 60_000 for k in keys)
    target = KVCache(spec)
    result = store.load_into(target, tokens)
    assert (result.positions, result.miss) == (2 * C, None)
    assert same_positions(source, target, 2 * C)
    backend.delete(keys)
    assert store.lookup(tokens) == 0
    backend.close()


def test_redis_kivi_pair_saves_whole_groups(redis_server, rng):
    """K q4_1ch / V q4_1 (KIVI): chunks of 32 positions hold whole groups of K codes (the
    open group, in the cache's float16 residual, is never saved); a pool with the store
    continues a prompt from them."""
    spec = spec_of("q4_1ch/q4_1")
    tokens = rng.integers(0, 50000, 2 * 32 + 7)
    source = computed(spec, tokens)
    backend = RedisBackend(redis_server.url)
    store = KVStore(backend, model="redis-kivi", spec=spec, chunk_tokens=32, page_size=32)
    assert store.save(source.snapshot(), tokens) == 2
    pool = kvcore.KVPool(spec, 8, 32, prefix_cache=True, store=store)
    seq, n = pool.match_prefix(tokens)
    assert n == 64 and pool.stats.store_hits == 2
    prefill(pool, tokens[64:], seq)
    for layer in range(spec.num_layers):
        for which in "kv":
            np.testing.assert_array_equal(pool.dequantize(seq, layer, which),
                                          source.dequantize(layer, which))
    with pytest.raises(kvcore.FormatError, match="chunk_tokens must be a multiple of 32"):
        KVStore(backend, model="redis-kivi", spec=spec, chunk_tokens=16, page_size=16)
    backend.delete(store.keys(tokens))
    backend.close()


def test_redis_cluster_spreads_chunks_over_the_nodes(redis_cluster, rng):
    import redis
    spec = spec_of("int8")
    tokens = rng.integers(0, 50000, 12 * C + 1)
    source = computed(spec, tokens)
    backend = RedisBackend(redis_cluster.url, cluster=True)
    assert backend.cluster
    store = KVStore(backend, model="cluster-test", spec=spec, chunk_tokens=C)
    assert store.save(source.snapshot(), tokens) == 12
    held = [redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes]
    assert sum(held) >= 12 and sum(h > 0 for h in held) >= 2  # keys on more than one node
    target = KVCache(spec)
    result = store.load_into(target, tokens)
    assert (result.positions, result.miss) == (12 * C, None)
    assert same_positions(source, target, 12 * C)
    backend.close()


def test_a_cluster_node_killed_fails_store_calls_by_name(server_factory, rng):
    from _servers import free_port
    with pytest.raises(StoreError, match=r"^redis cluster redis://127\.0\.0\.1:\d+: connect failed: "
                                         r"RedisClusterException"):
        RedisBackend(f"redis://127.0.0.1:{free_port()}", cluster=True)
    cluster = server_factory(cluster=True)
    spec = spec_of("int8")
    tokens = rng.integers(0, 50000, 6 * C + 1)
    store = KVStore(RedisBackend(cluster.url, cluster=True), model="m", spec=spec, chunk_tokens=C)
    assert store.save(computed(spec, tokens).snapshot(), tokens) == 6
    dead = cluster.nodes[1]
    dead.kill()
    with pytest.raises(StoreError, match=rf"^redis cluster {cluster.url}: GET of 6 keys failed: "
                                         rf"ConnectionError: .*127\.0\.0\.1:{dead.port}"):
        store.load(tokens)


def share_through_server(url, spec, tmp_path, rng, reader="reader", writer="writer"):
    """A writer process saves a prompt's chunks to the server, a reader process (a
    KVCache, or a KVPool with reader="reader-pool", a pool's prefix cache with
    "reader-prefix") loads them, computes the rest and decodes; returns (what the reader
    printed, as JSON: the positions it loaded, its attention outputs, the outputs of this
    process computing everything itself), tests/_store_child.py."""
    import json
    prompt = rng.integers(0, 50000, 5 * C + 7)
    new = rng.integers(0, 50000, 6)
    np.save(tmp_path / "prompt.npy", prompt)
    np.save(tmp_path / "new.npy", new)
    fields = json.dumps(dict(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                             head_dim=spec.head_dim, capacity=spec.capacity,
                             num_heads=spec.num_heads, format=spec.format))
    args = [url, fields, str(tmp_path / "prompt.npy"), str(tmp_path / "new.npy")]
    child = [sys.executable, os.path.join(TESTS, "_store_child.py")]
    env = dict(os.environ, PYTHONPATH=ROOT_DIR)  # the kvcore under test
    subprocess.run(child + [writer, *args], check=True, env=env)
    run = subprocess.run(child + [reader, *args, str(tmp_path / "out.npy")],
                         check=True, env=env, capture_output=True, text=True)
    cache = KVCache(spec)
    prefill(cache, prompt)
    return json.loads(run.stdout), np.load(tmp_path / "out.npy"), decode(cache, new)


def test_two_processes_share_a_prefix_through_the_server(redis_server, tmp_path, rng):
    loaded, got, expected = share_through_server(redis_server.url, spec_of("int8"), tmp_path, rng)
    assert loaded == 5 * C  # the reader computed only the last 7 prompt tokens
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_a_server_killed_mid_run_fails_store_calls_and_decoding_goes_on(server_factory, rng):
    server = server_factory()
    spec = spec_of("int8")
    prompt = rng.integers(0, 50000, 4 * C + 1)
    store = KVStore(RedisBackend(server.url), model="m", spec=spec, chunk_tokens=C)
    cache = KVCache(spec)
    prefill(cache, prompt[:2 * C + 1])
    writer = StoreWriter(store)
    assert writer.submit(cache.snapshot(), prompt[:2 * C + 1])
    writer.flush()
    assert writer.stats.chunks_written == 2
    server.kill()
    decode(cache, prompt[2 * C + 1:3 * C])  # the cache decodes on
    with pytest.raises(StoreError, match=rf"^redis 127\.0\.0\.1:{server.port}: GET of 4 keys "
                                         rf"failed: ConnectionError"):
        store.load(prompt)
    with pytest.raises(StoreError, match="EXISTS of 3 keys failed"):
        store.save(cache.snapshot(), prompt[:3 * C])
    assert writer.submit(cache.snapshot(), prompt[:3 * C])
    writer.flush()
    assert writer.stats.failed == 1 and "ConnectionError" in writer.stats.last_error
    out = decode(cache, prompt[3 * C:])
    assert np.isfinite(out).all() and cache.length == 4 * C + 1
    writer.close()


def test_eviction_by_the_server_is_a_miss(server_factory, rng):
    server = server_factory("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    spec = spec_of("f32", num_layers=2, num_kv_heads=2, head_dim=32)  # 16 KiB a chunk
    store = KVStore(RedisBackend(server.url), model="m", spec=spec, chunk_tokens=C)
    prompts = [rng.integers(0, 50000, 4 * C + 1) for _ in range(60)]  # 4 MB in all
    sources = [computed(spec, p) for p in prompts]
    for p, s in zip(prompts, sources):
        store.save(s.snapshot(), p)
    info = store.backend.client.info("stats")
    assert info["evicted_keys"] > 0
    found = 0
    for p, s in zip(prompts, sources):
        target = KVCache(spec)
        result = store.load_into(target, p)
        assert result.positions < 4 * C or result.miss is None
        if result.positions:
            assert same_positions(s, target, result.positions)
        found += result.positions > 0
    assert 0 < found < len(prompts)  # the newest prompts are there, the oldest were evicted


def test_pair_chunks_say_both_formats_and_refuse_another(tmp_path, rng):
    """A K q8_0 / V q4_0 store: its keys and chunks name the pair; a chunk of it is refused
    by a store of another pair or of one format (ChunkError naming both), and the store
    refuses a snapshot or a target of another pair (naming each side), nothing written."""
    spec = spec_of("q8_0/q4_0")
    store = KVStore(DirectoryBackend(tmp_path), model="m", spec=spec, chunk_tokens=C)
    tokens = rng.integers(0, 50000, 2 * C)
    assert ":q8_0/q4_0:" in store.keys(tokens)[0]
    assert store.save(computed(spec, tokens).snapshot(), tokens) == 2
    loaded = store.load(np.append(tokens, 7))   # the last token's query is still computed
    assert loaded.positions == 2 * C and loaded.snapshot.spec.format == "q8_0/q4_0"
    back = KVCache(spec)
    back.restore(loaded.snapshot)
    assert back.length == 2 * C
    kind, key, toks, parts, value = _chunk(spec, rng)
    for other in ("q8_0", "q4_0/q8_0"):
        with pytest.raises(ChunkError, match=rf"format 'q8_0/q4_0' \(expected '{other}'\)"):
            decode_chunk(ChunkKind(kind.model, spec_of(other), C), key, toks, value)
    wrong = computed(spec_of("q8_0/f16"), tokens).snapshot()
    with pytest.raises(SnapshotError, match=r"format q8_0/f16 \(K q8_0, V f16\) does not match "
                                            r"the store's q8_0/q4_0 \(K q8_0, V q4_0\)"):
        store.save(wrong, tokens)
    target = KVCache(spec_of("q8_0"))
    with pytest.raises(SnapshotError, match=r"target's format q8_0 does not match the store's "
                                            r"q8_0/q4_0 \(K q8_0, V q4_0\)"):
        store.load_into(target, tokens)
    assert target.length == 0
