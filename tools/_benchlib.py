"""Timing and table printing shared by the benchmark scripts."""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np


# K format / V format pairs the benchmarks measure beside the formats: llama.cpp's -ctk
# q8_0 -ctv q4_0 and K f16 / V q4_0, and KIVI's K by channel (q4_1ch) with a 4-bit V
PAIRS = ("q8_0/q4_0", "f16/q4_0", "q4_1ch/q4_1", "q4_1ch/q4_0")


def _batch_times(fn: Callable[[], object], repeat: int, warmup: int, number: int) -> list[float]:
    """Seconds of one call of fn in each of `repeat` timed batches of `number` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return times


def median_time(fn: Callable[[], object], *, repeat: int = 15, warmup: int = 3,
                number: int = 1) -> float:
    """Median seconds of one call of fn over `repeat` timed batches of `number` calls."""
    return float(np.median(_batch_times(fn, repeat, warmup, number)))


def best_time(fn: Callable[[], object], *, repeat: int = 15, warmup: int = 3,
              number: int = 1) -> float:
    """Least seconds of one call of fn over `repeat` timed batches of `number` calls (steady
    where other load on a shared machine only ever adds time)."""
    return min(_batch_times(fn, repeat, warmup, number))


def best_times(fns: Sequence[Callable[[], object]], *, repeat: int = 15, warmup: int = 3,
               number: int = 1) -> list[float]:
    """best_time of each of fns, their batches taken in turn (round r times every fn
    before round r + 1), so that a slow spell of the machine reaches all of them alike."""
    rounds = [_batch_times(fn, 1, warmup, number) for fn in fns]
    for _ in range(repeat - 1):
        for fn, times in zip(fns, rounds):
            times += _batch_times(fn, 1, 0, number)
    return [min(times) for times in rounds]


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A markdown table, so it pastes into the README as printed."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(cell(v) for v in r) + " |")


def copy_bandwidth(nbytes: int, repeat: int = 10) -> float:
    """np.copyto bandwidth in GB/s, counting bytes read plus bytes written."""
    src = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    t = median_time(lambda: np.copyto(dst, src), repeat=repeat)
    return 2 * src.nbytes / t / 1e9
