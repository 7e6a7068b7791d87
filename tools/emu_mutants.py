#!/usr/bin/env python3
"""Shows that the GPU tests bite: injects typical kernel bugs into a copy of cuda/, runs the
relevant tests on the emulator built from the copy, and prints which tests catch each.

    python3 tools/emu_mutants.py                 # every mutant (several minutes)
    python3 tools/emu_mutants.py missing-barrier # some of them, by name

Each mutant replaces one exact piece of source text (it must occur exactly once) in a
temporary copy of cuda/; pytest runs in a child process with a plugin that points the
emulator's builder at the copy (kvcore.gpu._emu.kernels.set_source_dir) and --gpu=emu. The
shipped PTX is untouched (the emulated driver still checks launches against it). A mutant
that no test catches is a gap in the tests. The table goes into docs/gpu.md.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION_TESTS = ["tests/test_gpu_attention.py", "tests/test_emu_kernels.py", "-k", "attention"]
POOL_TESTS = ["tests/test_gpu_pool.py", "tests/test_gpu_pool_graph.py"]
APPEND_TESTS = ["tests/test_gpu_cache.py", "tests/test_emu_kernels.py", "-k", "append or cache or f16"]
Q4_TESTS = ["tests/test_gpu_cache.py", "tests/test_gpu_attention.py", "-k", "q4 or 4bit"]
GROUP_TESTS = ["tests/test_gpu_groups.py"]
VARIANT_TESTS = ["tests/test_gpu_attention.py", "tests/test_emu_kernels.py", "tests/test_gpu_pool.py",
                 "tests/test_gpu_graph.py", "-k", "variant or window or sink"]

# name: (file, original text, mutated text, what it models, tests to run)
MUTANTS = {
    "group-write-unchecked": (
        "kv_append.cu",
        "    if (mode == 2 && status[s] != 0) return;",
        "",
        "K q4_1ch: the writing launch of T rows ignores what the checking launch refused",
        GROUP_TESTS),
    "pool-group-write-unchecked": (
        "paged.cu",
        "    if (slot < 0 || (mode == 2 && *status != 0)) return;",
        "    if (slot < 0) return;",
        "K q4_1ch pool: the writing launch ignores what the checking launch refused",
        GROUP_TESTS),
    "group-unrounded": (
        "encode.cuh",
        "        return kv_round_f16(kv_load_input(k_in, in_dtype, in_base + (p - pos) * s_r + c));",
        "        return kv_load_input(k_in, in_dtype, in_base + (p - pos) * s_r + c);",
        "K q4_1ch: a group is encoded from its float32 input, not the float16 values the residual "
        "and the CPU hold",
        GROUP_TESTS),
    "group-nibble": (
        "attention.cuh",
        "        const int shift = (r >> 4) << 2, b = r & 15;",
        "        const int shift = (r >> 3 & 1) << 2, b = r & 15;",
        "K q4_1ch attention: positions 8..15 of a group read the high nibble",
        GROUP_TESTS),
    "missing-barrier": (
        "attention.cuh",
        "        __syncthreads();\n\n        // b. online softmax",
        "\n        // b. online softmax",
        "no __syncthreads between the partial scores and the softmax that reads them",
        ATTENTION_TESTS),
    "wait-group-too-few": (
        "attention.cuh",
        "kv_cp_wait<C::STAGES - 2>();",
        "kv_cp_wait<C::STAGES - 1>();",
        "cp.async.wait_group one too high: the tile about to be read may still be in flight",
        ATTENTION_TESTS),
    "tail-off-by-one": (
        "attention.cuh",
        "                    if (r < rows) {",
        "                    if (r <= rows) {",
        "the softmax takes one row past the last valid one of a tile",
        ATTENTION_TESTS),
    "sum-not-rescaled": (
        "attention.cuh",
        "l_run[h] = l_run[h] * a + psum;",
        "l_run[h] = l_run[h] + psum;",
        "the running softmax sum is not rescaled when the running max moves",
        ATTENTION_TESTS),
    "window-off-by-one": (
        "attention.cuh",
        "    int lo = window > 0 && n > window ? n - window : 0;",
        "    int lo = window > 0 && n > window ? n - window + 1 : 0;",
        "the sliding window leaves out its oldest position",
        VARIANT_TESTS),
    "sink-logit-every-split": (
        "attention.cuh",
        "            if (sinks != nullptr && split == 0) {  // the sink joins the denominator once",
        "            if (sinks != nullptr) {  // the sink joins the denominator once",
        "every split adds the sink logit to its denominator (the merge counts it nsplit times)",
        VARIANT_TESTS),
    "softcap-ignored": (
        "attention.cuh",
        "                        s[i] = cap > 0.0f ? cap * tanhf(v / cap) : v;",
        "                        s[i] = v;",
        "soft-capping is not applied",
        VARIANT_TESTS),
    "sink-tile-reads-the-gap": (
        "attention.cuh",
        "        return min(T, (v0 < w[0] ? w[2] : end) - v0);",
        "        return min(T, end - v0);",
        "the tile of the sink positions also takes the rows after them (positions outside the "
        "window, whose pages a windowed pool may have released)",
        VARIANT_TESTS),
    "int8-truncates": (
        "common.cuh",
        "int q = __float2int_rn(__fdiv_rn(x, s));",
        "int q = __float2int_rz(__fdiv_rn(x, s));",
        "the int8 encoder truncates instead of rounding to nearest even",
        APPEND_TESTS),
    "e4m3-ties-away": (
        "common.cuh",
        "u += 0x7FFFFu + ((u >> 20) & 1u);       // RNE to 3 mantissa bits",
        "u += 0x80000u;                          // ties away from zero",
        "the fp8 e4m3 encoder rounds ties away from zero instead of to even",
        APPEND_TESTS),
    "q4_0-last-max": (
        "encode.cuh",
        "__shfl_sync(0xffffffffu, x, __ffs(__ballot_sync(0xffffffffu, fabsf(x) == amax)) - 1);",
        "__shfl_sync(0xffffffffu, x, 31 - __clz(__ballot_sync(0xffffffffu, fabsf(x) == amax)));",
        "the q4_0 encoder takes the last of the values of largest |x| instead of the first",
        Q4_TESTS),
    "q4-nibbles-swapped": (
        "attention.cuh",
        "const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;",
        "const uint32_t hi = w & 0x0F0F0F0Fu, lo = (w >> 4) & 0x0F0F0F0Fu;",
        "the 4-bit decoder reads a byte's high nibble as value j and its low one as 16 + j",
        Q4_TESTS),
    "q4_1-d-m-swapped": (     # (fusing q * d + m is no bug: q * d is exact, f16 x 4 bits)
        "attention.cuh",
        "f[k] = __fadd_rn(__fmul_rn(f[k], dm[0]), dm[1]);",
        "f[k] = __fadd_rn(__fmul_rn(f[k], dm[1]), dm[0]);",
        "the q4_1 decoder reads a block's (d, m) as (m, d)",
        Q4_TESTS),
    "short-launch-unchecked": (
        "paged.cu",
        "const bool short_launch = T < cap && slots[T] != -1;",
        "const bool short_launch = false;",
        "the paged append writes a launch of fewer rows than the step's new positions",
        POOL_TESTS),
}


class SourcePlugin:
    """Points the emulator's builder at a copy of cuda/ (loaded in the child)."""

    def __init__(self, path: str):
        self.path = path

    def pytest_configure(self, config):
        from kvcore.gpu._emu import kernels
        kernels.set_source_dir(self.path)


def child_main(source: str, args: list[str]) -> int:
    import pytest
    return pytest.main(args, plugins=[SourcePlugin(source)])


def run_tests(source: str, tests: list[str]) -> tuple[list[str], str, float]:
    """(failed test ids, pytest's summary line, seconds) for the tests on `source`."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import emu_mutants; "
            "sys.exit(emu_mutants.child_main(sys.argv[2], sys.argv[3:]))")
    cmd = [sys.executable, "-c", code, os.path.join(ROOT, "tools"), source, "--gpu=emu", "-q",
           "-rf", "-p", "no:cacheprovider", *tests]
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", res.stdout, re.M)
    summary = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-300:]
    return failed, summary, time.perf_counter() - t


def mutate(tmp: str, name: str) -> str:
    """A copy of cuda/ under tmp with mutant `name` applied; returns its path."""
    fname, old, new = MUTANTS[name][:3]
    dst = os.path.join(tmp, name, "cuda")
    shutil.copytree(os.path.join(ROOT, "cuda"), dst)
    path = os.path.join(dst, fname)
    with open(path) as f:
        text = f.read()
    if text.count(old) != 1:
        sys.exit(f"mutant {name}: the text to replace occurs {text.count(old)} times in cuda/{fname}")
    with open(path, "w") as f:
        f.write(text.replace(old, new))
    return dst


def main() -> int:
    names = sys.argv[1:] or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        sys.exit(f"unknown mutants {unknown}: choose from {list(MUTANTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "original", "cuda")  # named cuda/: same cache keys as cuda/
        shutil.copytree(os.path.join(ROOT, "cuda"), base)
        failed, summary, secs = run_tests(base, ATTENTION_TESTS[:2] + APPEND_TESTS[:1])
        print(f"unmutated copy: {summary} ({secs:.0f} s)", flush=True)
        if failed:
            print("the unmutated sources fail tests, the table would mean nothing:", *failed, sep="\n  ")
            return 1
        for name in names:
            src = mutate(tmp, name)
            failed, summary, secs = run_tests(src, MUTANTS[name][4])
            rows.append((name, MUTANTS[name][3], failed, summary))
            print(f"{name}: {summary} ({secs:.0f} s)", flush=True)
    print("\n| mutant | bug | caught by |\n|---|---|---|")
    for name, what, failed, summary in rows:
        if failed:
            shown = ", ".join(f"`{f.split('::')[-1]}`" for f in failed[:4])
            more = f" (+{len(failed) - 4} more)" if len(failed) > 4 else ""
            caught = f"{len(failed)} tests: {shown}{more}"
        else:
            caught = f"**not caught** ({summary})"
        print(f"| {name} | {what} | {caught} |")
    return 0 if all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
