"""The chunk store: content keys, the chunk codec and its refusals, the directory
backend, Redis (a single server and a three-master cluster, real servers started by the
fixtures in conftest.py), two processes sharing a prefix, a server killed mid-run, and
eviction by the server."""
import hashlib
import os
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

import kvcore
from kvcore import KVCache, KVSpec
from kvcore._prefix_keys import ROOT, encode_extra, prefix_keys, token_array
from kvcore.errors import ChunkError, DTypeError, RangeError, SnapshotError, StoreError
from kvcore.store import (DirectoryBackend, KVStore, RedisBackend, StoreWriter, decode_chunk,
                          encode_chunk)
from kvcore.store._codec import MAGIC, ChunkKind

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


@pytest.mark.parametrize("fmt", kvcore.FORMATS)
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
