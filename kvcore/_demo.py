"""python -m kvcore demo: a model-shaped cache in every format, filled, then decoded.

1. Storage, per format: memory, the time of one decode step (append one position to
   every layer, then advance), a check that every position reads back as its format's
   rule says, and the relative RMS error of the round trip on Gaussian keys and
   Student-t(3) values.
2. Decode, per format: a model-shaped decode loop (seeded random q, k, v per layer, keys
   with outlier channels, values heavy-tailed, RoPE on q and k, append, attend, advance)
   after a prompt; bytes per position, compression ratio, the attention output's error
   against the same loop on an f32 cache, and tokens per second.
3. Serving: requests of different prompt and output lengths decoding together from one
   KVPool (one batched append and one batched attention call per layer per step),
   joining and leaving as they come and finish; pages in use against what a
   full-capacity KVCache per request would take.
4. Store, no setup: a prompt's K/V saved in chunks to a directory store (a temporary
   directory), then loaded into a new KVPool sequence for a second request with the same
   prompt; the attention over the loaded prefix equals the original bit for bit.
5. Prefix cache: requests that share a system prompt, admitted with `match_prefix` into
   a pool with a prefix cache: pages found, positions computed, pages in use, and the
   first decode step's attention against a KVCache that computed the whole prompt.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TextIO

import numpy as np

import kvcore

LAYERS, KV_HEADS, HEAD_DIM, CAPACITY = 32, 8, 128, 4096
POOL = 64  # distinct step inputs, cycled: position p of layer l holds pool[(p + l) % POOL]
Q_HEADS, PROMPT, STEPS = 32, 512, 16    # the decode loop: query heads, prompt, new tokens
OUTLIERS = 4                            # key channels per head 10x larger (as real K has)


def print_table(header: list[str], rows: list[list[object]], *, title: str = "") -> None:
    """Columns padded to their widest cell (numbers right-aligned)."""
    cells = [[str(c) for c in r] for r in [header] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = [all(isinstance(r[i], (int, float)) or str(r[i])[:1].isdigit() for r in rows)
             for i in range(len(header))]
    if title:
        print(f"\n{title}")
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) if a else c.ljust(w) for c, w, a in zip(r, widths, right)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _expected_codes(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray | None]:
    """What the cache must hold for input x [..., D]: the format's rule, computed apart
    from the cache (numpy for f32/f16, kvcore.quantize for the others)."""
    if fmt == "f32":
        return x, None
    if fmt == "f16":
        return x.astype(np.float16), None
    return kvcore.quantize(x, fmt)


def _rel_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(np.mean((approx - exact) ** 2) / np.mean(exact.astype(np.float64) ** 2)))


def run_format(fmt: str, keys: np.ndarray, vals: np.ndarray, *, layers: int = LAYERS,
               capacity: int = CAPACITY) -> list[object]:
    """One row of the table. keys, vals: float32 [POOL, Hkv, D]."""
    spec = kvcore.KVSpec(num_layers=layers, num_kv_heads=keys.shape[1], head_dim=keys.shape[2],
                         capacity=capacity, format=fmt)
    cache = kvcore.KVCache(spec)
    cache._storage[:] = 0  # touch the fresh pages first: time steps, not page faults
    t0 = time.perf_counter()
    for p in range(capacity):
        for layer in range(layers):
            i = (p + layer) % POOL
            cache.append(layer, keys[i], vals[i])
        cache.advance()
    per_step = (time.perf_counter() - t0) / capacity
    want = [_expected_codes(x, fmt) for x in (keys, vals)]
    ok = True
    for layer in range(layers):
        order = (np.arange(capacity) + layer) % POOL
        got = [(cache.keys(layer), cache.key_scales(layer)),
               (cache.values(layer), cache.value_scales(layer))]
        for (codes, scales), (w_codes, w_scales) in zip(got, want):
            ok &= np.array_equal(codes.view(np.uint8), w_codes[order].view(np.uint8))
            ok &= w_scales is None or (scales is not None
                                       and np.array_equal(scales, w_scales[order]))
    order = np.arange(capacity) % POOL
    err_k = _rel_rms(cache.dequantize(0, "k"), keys[order])
    err_v = _rel_rms(cache.dequantize(0, "v"), vals[order])
    return [fmt, f"{spec.memory_bytes / 2**20:.0f}", spec.bytes_per_position,
            f"{spec.compression_ratio:.2f}", f"{per_step * 1e6:.1f}",
            "exact" if ok and fmt == "f32" else "as rule" if ok else "MISMATCH",
            f"{err_k:.2e}", f"{err_v:.2e}"]


def model_pools(rng: np.random.Generator, n: int, kv_heads: int, q_heads: int,
                head_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n distinct rows of q [n, Hq, D], k and v [n, Hkv, D], float32: Gaussian q, keys
    with OUTLIERS fixed channels per head scaled 10x, Student-t(3) values."""
    q = rng.standard_normal((n, q_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((n, kv_heads, head_dim)).astype(np.float32)
    for h in range(kv_heads):
        k[:, h, rng.choice(head_dim, OUTLIERS, replace=False)] *= 10
    v = rng.standard_t(3, (n, kv_heads, head_dim)).astype(np.float32)
    return q, k, v


class Progress:
    """A one-line progress bar, drawn only where a person watches: when the stream
    (stderr by default) is a terminal. Into a log file or a pipe it writes nothing, so
    no carriage-return debris lands in logs."""

    def __init__(self, total: int, width: int = 30, stream: TextIO | None = None):
        self.total, self.width, self.done = total, width, 0
        self.stream = sys.stderr if stream is None else stream
        self.shown = self.stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.shown:
            return
        filled = self.width * self.done // self.total
        self.stream.write(f"\rdecode [{'#' * filled}{'-' * (self.width - filled)}] "
                          f"{100 * self.done // self.total:3d}% {label:<10}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def decode_format(fmt: str, pools: tuple[np.ndarray, np.ndarray, np.ndarray], *,
                  layers: int = LAYERS, prompt: int = PROMPT, steps: int = STEPS,
                  progress: Progress | None = None) -> tuple[np.ndarray, float]:
    """The decode loop on a cache in fmt: the prompt's k, v appended (RoPE on k), then per
    new token and layer: RoPE on q and k, append, decode_attention, and advance.
    Position p of layer l takes pool row (p + 7 l) % rows. Returns the attention outputs
    float32 [steps, layers, Hq, D] and the seconds of the decode steps."""
    q_pool, k_pool, v_pool = pools
    rows, hq, d = q_pool.shape
    spec = kvcore.KVSpec(num_layers=layers, num_kv_heads=k_pool.shape[1], head_dim=d,
                         capacity=prompt + steps, num_heads=hq, format=fmt)
    cache = kvcore.KVCache(spec)
    cache._storage[:] = 0  # touch the fresh pages first: time steps, not page faults
    positions = np.arange(prompt)
    for layer in range(layers):
        idx = (positions + 7 * layer) % rows
        cache.append(layer, kvcore.apply_rope(k_pool[idx], positions), v_pool[idx])
    cache.advance()
    outs = np.empty((steps, layers, hq, d), np.float32)
    t0 = time.perf_counter()
    for s in range(steps):
        p = prompt + s
        for layer in range(layers):
            i = (p + 7 * layer) % rows
            q = kvcore.apply_rope(q_pool[i].copy(), p)
            cache.append(layer, kvcore.apply_rope(k_pool[i].copy(), p), v_pool[i])
            kvcore.decode_attention(q, cache, layer, out=outs[s, layer])
        cache.advance()
        if progress is not None:
            progress.step(fmt)
    return outs, time.perf_counter() - t0


def decode_rows(formats: list[str], pools: tuple[np.ndarray, np.ndarray, np.ndarray],
                **sizes: int) -> list[list[object]]:
    """One row per format: bytes/pos, ratio, attention error vs f32, tokens/s."""
    progress = Progress(len(formats) * sizes.get("steps", STEPS))
    results = {fmt: decode_format(fmt, pools, progress=progress, **sizes) for fmt in formats}
    ref = results["f32"][0]
    rows = []
    for fmt, (outs, secs) in results.items():
        spec = kvcore.KVSpec(num_layers=sizes.get("layers", LAYERS),
                             num_kv_heads=pools[1].shape[1], head_dim=pools[1].shape[2],
                             capacity=1, format=fmt)
        rows.append([fmt, spec.bytes_per_position, f"{spec.compression_ratio:.2f}",
                     f"{_rel_rms(outs, ref):.2e}", f"{outs.shape[0] / secs:.1f}"])
    return rows


SERVE_REQUESTS = [(900, 12), (150, 20), (480, 8), (20, 28), (1300, 4), (250, 16)]
"""(prompt length, new tokens) of each request; one joins every SERVE_EVERY steps."""
SERVE_EVERY, SERVE_PAGE, SERVE_BATCH = 4, 16, 4


def serve(requests: list[tuple[int, int]] = SERVE_REQUESTS, *, layers: int = LAYERS, capacity: int = CAPACITY,
          fmt: str = "int8", every: int = SERVE_EVERY, page_size: int = SERVE_PAGE,
          batch: int = SERVE_BATCH, seed: int = 1) -> list[list[object]]:
    """Requests decoding together from one pool: a request joins every `every` steps while
    fewer than `batch` run (its prompt appended in one call per layer), each step appends
    one position per running request and layer in one append_batch call, attends with one
    decode_attention call per layer, advances; a request that has made its tokens is freed.
    Returns a row per step where the set of requests changed (and the last step): step,
    running requests and their lengths, pages in use, MiB in use, MiB that one
    full-capacity KVCache per running request would take."""
    rng = np.random.default_rng(seed)
    spec = kvcore.KVSpec(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                         capacity=capacity, num_heads=Q_HEADS, format=fmt)
    need = sum(-(-(p + n) // page_size) for p, n in requests)
    pool = kvcore.KVPool(spec, num_pages=need, page_size=page_size)
    page_mib = page_size * spec.bytes_per_position / 2**20
    waiting, running, left = list(requests), list[int](), dict[int, int]()
    rows: list[list[object]] = []
    step = 0
    while waiting or running:
        changed = False
        if waiting and len(running) < batch and step % every == 0:
            prompt, tokens = waiting.pop(0)
            s = pool.new_sequence()
            for layer in range(layers):
                k = rng.standard_normal((prompt, KV_HEADS, HEAD_DIM), dtype=np.float32)
                pool.append(k, k, seq=s, layer=layer)
            pool.advance(s)
            running.append(s)
            left[s] = tokens
            changed = True
        k = rng.standard_normal((len(running), KV_HEADS, HEAD_DIM), dtype=np.float32)
        q = rng.standard_normal((len(running), Q_HEADS, HEAD_DIM), dtype=np.float32)
        for layer in range(layers):
            pool.append_batch(k, k, seqs=running, layer=layer)
            kvcore.decode_attention(q, pool, layer, seqs=running)
        pool.advance(running)
        step += 1
        for s in list(running):
            left[s] -= 1
            if left[s] == 0:
                running.remove(s)
                pool.free(s)
                changed = True
        if changed or not (waiting or running):
            lengths = [pool.length(s) for s in running]
            rows.append([step, len(running), " ".join(map(str, lengths)) or "-",
                         pool.num_used_pages, f"{pool.num_used_pages * page_mib:.1f}",
                         f"{len(running) * spec.memory_bytes / 2**20:.1f}"])
    return rows


SYSTEM = 1000                                   # the shared system prompt's tokens
SHARED_REQUESTS = [40, 200, 7, 120]             # each request's own tokens after it


def shared_prompt(own: list[int] = SHARED_REQUESTS, *, system: int = SYSTEM, layers: int = LAYERS,
                  fmt: str = "int8", page_size: int = 16, seed: int = 2) -> list[list[object]]:
    """Requests of `system` shared tokens and own[i] tokens each, one after another into one
    prefix-cached pool (each stays running); K/V of a position is a function of its token
    and position. Returns a row per request: own tokens, positions found by match_prefix,
    positions computed, pages in use, cached pages, and whether its first decode step's
    attention (last layer) equals, bit for bit, a KVCache's that computed every position."""
    rng = np.random.default_rng(seed)
    spec = kvcore.KVSpec(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                         capacity=system + max(own) + 1, num_heads=Q_HEADS, format=fmt)
    pool = kvcore.KVPool(spec, num_pages=sum(-(-(system + n) // page_size) for n in own),
                         page_size=page_size, prefix_cache=True)
    table = rng.standard_normal((97, KV_HEADS, HEAD_DIM), dtype=np.float32)
    head = rng.integers(0, 32000, system)
    q = rng.standard_normal((1, Q_HEADS, HEAD_DIM), dtype=np.float32)
    rows = []
    for n in own:
        tokens = np.concatenate([head, rng.integers(0, 32000, n)])
        kv = table[(tokens + np.arange(len(tokens))) % len(table)]
        s, found = pool.match_prefix(tokens)
        cache = kvcore.KVCache(spec)
        for layer in range(layers):
            pool.append(kv[found:], kv[found:], seq=s, layer=layer)
            cache.append(layer, kv, kv)
        pool.advance(s, tokens=tokens[found:])
        cache.advance()
        same = np.array_equal(kvcore.decode_attention(q, pool, layers - 1, seqs=[s])[0],
                              kvcore.decode_attention(q[0], cache, layers - 1))
        rows.append([f"{system} + {n}", found, len(tokens) - found, pool.num_used_pages,
                     pool.num_cached_pages, "yes" if same else "NO"])
    return rows


@dataclass(frozen=True)
class Sizes:
    """What the demo runs: the model's layers, the cache's positions, the decode loop's
    prompt and new tokens, the serving requests (prompt, new tokens), the shared-prompt
    requests (system prompt, own tokens of each)."""

    layers: int = LAYERS
    capacity: int = CAPACITY
    prompt: int = PROMPT
    steps: int = STEPS
    requests: tuple[tuple[int, int], ...] = tuple(SERVE_REQUESTS)
    system: int = SYSTEM
    own: tuple[int, ...] = tuple(SHARED_REQUESTS)


FULL = Sizes()
QUICK = Sizes(layers=4, capacity=512, prompt=128, steps=8,
              requests=((300, 6), (40, 10), (120, 4)), system=96, own=(10, 40, 3))
"""--quick: every part of the demo at a few seconds' size."""


def _conditions() -> str:
    """The threads kvcore uses and how busy the machine is (speeds depend on both)."""
    n = kvcore.max_threads()
    note = f"{n} thread{'' if n == 1 else 's'} of {os.cpu_count()} CPUs"
    if hasattr(os, "getloadavg"):
        load = os.getloadavg()[0]
        note += f"; load average {load:.1f}"
        if load > (os.cpu_count() or 1):
            note += ": other processes share the cores, speeds are lower than idle"
    return note


def main(sizes: Sizes = FULL) -> None:
    """Prints the demo's tables; SystemExit when a check fails."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((POOL, KV_HEADS, HEAD_DIM)).astype(np.float32)
    vals = rng.standard_t(3, (POOL, KV_HEADS, HEAD_DIM)).astype(np.float32)
    L = sizes.layers
    print(f"kvcore {kvcore.__version__} demo: {L} layers, {KV_HEADS} kv heads, head_dim "
          f"{HEAD_DIM}, {sizes.capacity} positions, filled one decode step at a time\n"
          f"{_conditions()}")
    rows = [run_format(fmt, keys, vals, layers=L, capacity=sizes.capacity)
            for fmt in kvcore.formats.ROW_FORMATS]
    print_table(["format", "MiB", "bytes/pos", "ratio", "step us", "read-back",
                 "rel RMS gauss", "rel RMS t(3)"], rows)
    print(f"\nstep us: append one position (K and V, 8x128 float32) to each of {L} layers, "
          "then advance.\nread-back: every position of every layer equals its input "
          "encoded by the format's rule\n(f32: the input itself; f16: numpy astype; "
          "others: kvcore.quantize).\nrel RMS: sqrt(mean((x' - x)^2) / mean(x^2)) of the "
          "dequantized cache, Gaussian keys, Student-t(3) values.")
    if any(r[5] == "MISMATCH" for r in rows):
        raise SystemExit("read-back mismatch")
    print(f"\nDecode: a {sizes.prompt}-token prompt, then {sizes.steps} new tokens through {L} "
          f"layers ({Q_HEADS} query heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM})")
    pools = model_pools(rng, 256, KV_HEADS, Q_HEADS, HEAD_DIM)
    print_table(["format", "bytes/pos", "ratio", "attn rel RMS vs f32", "tokens/s"],
                decode_rows(list(kvcore.formats.ROW_FORMATS), pools, layers=L, prompt=sizes.prompt,
                            steps=sizes.steps))
    print("\nattn rel RMS vs f32: the attention outputs of every step and layer against the "
          f"same loop on an f32 cache.\ntokens/s: per new token, RoPE on q and k, append, "
          f"decode_attention in each of {L} layers, advance; {_conditions()}.")
    requests = list(sizes.requests)
    print(f"\nServing: {len(requests)} requests (prompt, new tokens) "
          f"{' '.join(f'({p}, {n})' for p, n in requests)} decoding together from one "
          f"int8 KVPool of {SERVE_PAGE}-position pages, at most {SERVE_BATCH} at a time, one "
          f"joining every {SERVE_EVERY} steps")
    print_table(["step", "running", "lengths", "pages in use", "MiB in use",
                 "MiB as full KVCaches"], serve(requests, layers=L, capacity=sizes.capacity))
    print(f"\nMiB as full KVCaches: one KVCache of capacity {sizes.capacity} per running "
          "request. Each step is one append_batch\nand one batched decode_attention call per "
          "layer for all running requests.")
    print_store_demo(sizes)
    print_prefix_demo(sizes)


def store_demo(*, layers: int = LAYERS, prompt: int = 2 * PROMPT + 1, chunk: int = 256,
               fmt: str = "int8") -> list[object]:
    """A prompt's K/V saved to a directory store and loaded into a new sequence of a
    KVPool; returns [positions loaded, chunks, MB stored, save ms, load ms, "bit-identical"
    or "DIFFERENT" (the attention over the loaded positions against the original's)]."""
    from .store import DirectoryBackend, KVStore
    rng = np.random.default_rng(1)
    spec = kvcore.KVSpec(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                         capacity=prompt, num_heads=Q_HEADS, format=fmt)
    tokens = rng.integers(0, 32000, prompt)
    first = kvcore.KVCache(spec)
    k = rng.standard_normal((prompt, KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_t(3, (prompt, KV_HEADS, HEAD_DIM)).astype(np.float32)
    for layer in range(layers):
        first.append(layer, k, v)
    first.advance()
    with tempfile.TemporaryDirectory() as root:
        store = KVStore(DirectoryBackend(root), model="demo@1", spec=spec, chunk_tokens=chunk)
        t0 = time.perf_counter()
        chunks = store.save(first.snapshot(), tokens)
        t1 = time.perf_counter()
        pool = kvcore.KVPool(spec, num_pages=-(-prompt // SERVE_PAGE), page_size=SERVE_PAGE)
        result = store.load_into(pool, tokens)   # a second request with the same prompt
        t2 = time.perf_counter()
        stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    q = rng.standard_normal((Q_HEADS, HEAD_DIM)).astype(np.float32)
    n = result.positions
    first.truncate(n)  # attend over the same positions in both
    same = n > 0 and all(np.array_equal(kvcore.decode_attention(q, first, layer),
                                        kvcore.decode_attention(q[None], pool, layer,
                                                                seqs=[result.seq])[0])
                         for layer in range(layers))
    return [n, chunks, f"{stored / 1e6:.1f}", f"{(t1 - t0) * 1e3:.0f}", f"{(t2 - t1) * 1e3:.0f}",
            "bit-identical" if same else "DIFFERENT"]


def print_store_demo(sizes: Sizes = FULL) -> None:
    prompt, chunk = 2 * sizes.prompt + 1, min(256, sizes.prompt)
    print(f"\nStore: a {prompt}-token int8 prompt saved to a directory store in chunks "
          f"of {chunk} tokens, then\nloaded into a KVPool sequence for a second request with "
          f"the same prompt (the last token is left to compute)")
    row = store_demo(layers=sizes.layers, prompt=prompt, chunk=chunk)
    print_table(["positions loaded", "chunks", "MB on disk", "save ms", "load ms",
                 "attention vs original"], [row])
    if row[-1] != "bit-identical":
        raise SystemExit("store round trip differs")


def print_prefix_demo(sizes: Sizes = FULL) -> None:
    print(f"\nPrefix cache: {len(sizes.own)} requests sharing a {sizes.system}-token system "
          "prompt, admitted one after another with match_prefix (int8, pages of 16)")
    rows = shared_prompt(list(sizes.own), system=sizes.system, layers=sizes.layers)
    print_table(["tokens", "found", "computed", "pages in use", "cached", "same attention"],
                rows)
    print("\nfound: positions match_prefix returned (full pages of the system prompt, shared "
          "by reference);\nsame attention: the first decode step over them equals, bit for "
          "bit, a KVCache's that computed every position.")
    if any(r[5] != "yes" for r in rows):
        raise SystemExit("prefix reuse mismatch")
