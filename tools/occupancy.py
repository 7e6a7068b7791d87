#!/usr/bin/env python3
"""Prints the occupancy table of docs/gpu.md ("Occupancy and bytes in flight"): for every
kernel, ptxas' registers and static shared memory on sm_90, the blocks an H100 keeps
resident per SM, the threads per SM, and an estimate of the K/V bytes each block and each
SM has in flight.

    python3 tools/occupancy.py                 # from cuda/resources.json (what ships)
    python3 tools/occupancy.py --ptx DIR       # ptxas -arch=sm_90 -v on DIR/*.ptx instead
                                               # (a trial build), with its spills
    python3 tools/occupancy.py --format csv    # one line per kernel

Occupancy: an H100 (132 SMs; per SM 65536 registers, allocated per warp in units of 256;
228 KB of shared memory, allocated per block in units of 128 bytes plus 1 KB the driver
reserves; 2048 threads; 32 blocks), blocks of 128 threads for the split kernels (the
others: the block kvcore launches them with, column `threads`).

Bytes in flight (K/V codes and scales a resident block has requested and not yet
received): the split kernels (cuda/attention.cuh) stream tiles of T positions (T * row
code bytes <= 4 KiB of K, 2 KiB for 4-bit codes, as much of V, and their scales) through a cp.async pipeline of
STAGES stages; at the top of each tile the block waits until at most STAGES - 2 tiles are
pending, then issues one more, so while it computes a tile STAGES - 1 tiles are in flight
(at most; STAGES - 2 just after the wait). The figure is that maximum,
(STAGES - 1) x T x 2 x (row code bytes + scale bytes), per block and times the resident
blocks per SM. The _dx instances are counted at D = 128. The other kernels do not stream:
they read one input row per warp (appends), one float per split and thread (merge) or
one row per block (rope) and write it back; their column is the bytes one resident block
reads per pass, for D = 128, f32 input.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESOURCES = os.path.join(ROOT, "cuda", "resources.json")

SMS, REGS_PER_SM, SMEM_PER_SM, THREADS_PER_SM, BLOCKS_PER_SM = 132, 65536, 228 * 1024, 2048, 32

CODE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "int8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "q8_0": 1,
              "q4_0": 1, "q4_1": 1, "q4_1ch": 1}
PACK = {"q4_0": 2, "q4_1": 2, "q4_1ch": 2}   # values per code byte (others: 1)
SCALE_BYTES = {"q8_0": 2 / 32, "q4_0": 2 / 32, "q4_1": 4 / 32, "q4_1ch": 4 / 32}   # per value (int8/fp8: 4 a row)
GROUP = 32   # K q4_1ch: a tile is one group of positions
# block sizes kvcore launches the other kernels with, and their reads per pass (D = 128)
OTHERS = {"kv_attn_merge": (128, 128 * 4, "one ws_o float per thread and split"),
          "kv_append": (256, 8 * 128 * 4, "one input head row (f32) per warp"),
          "kv_paged_append": (256, 8 * 128 * 4, "one input head row (f32) per warp"),
          "kv_advance": (32, 0, "lengths only"),
          "kv_rope": (128, 128 * 4, "a head row of q or k per pass")}
SPLIT = re.compile(r"kv_(p?attn)_(\w+?)_d(\d+|x)_g(\d+)$")


def resident(regs: int, smem: int, threads: int) -> tuple[int, str]:
    """(blocks per SM, what limits them) on an H100."""
    warps = -(-threads // 32)
    limits = {"blocks": BLOCKS_PER_SM, "threads": THREADS_PER_SM // (32 * warps)}
    if regs:
        limits["registers"] = REGS_PER_SM // (-(-regs * 32 // 256) * 256) // warps
    limits["shared"] = SMEM_PER_SM // (-(-(smem + 1024) // 128) * 128)
    n = min(limits.values())
    return n, next(k for k, v in limits.items() if v == n)


def split_in_flight(fmt: str, d: int, gb: int) -> int:
    """Bytes of K/V codes and scales one split-kernel block has in flight at most
    (cuda/attention.cuh AttnCfg: tile, STAGES); fmt: a format or a K/V pair "<k>_<v>"."""
    k, v = next(((a, b) for a in CODE_BYTES for b in CODE_BYTES if f"{a}_{b}" == fmt), (fmt, fmt))

    def dpt(f: str) -> int:
        return min(16 * PACK.get(f, 1) // CODE_BYTES[f], 8 if gb >= 4 else 16)

    def rb(f: str) -> int:                   # code bytes of a row
        return d * CODE_BYTES[f] // PACK.get(f, 1)

    def sb(f: str) -> int:                   # scale bytes of a row
        return int(d * SCALE_BYTES[f]) if f in SCALE_BYTES else 4 if CODE_BYTES[f] == 1 else 0

    tpr = d // min(dpt(k), dpt(v))
    rg = 128 // tpr
    rows_cap = min(4096 // PACK.get(k, 1) // rb(k), 4096 // PACK.get(v, 1) // rb(v), 64)
    tile = rg * max(rows_cap // rg, 1)      # 4 KiB of K a tile (2 KiB for 4-bit codes), as much of V
    if k == "q4_1ch":
        tile = GROUP
    stages = 3 if gb >= 8 else 4
    return (stages - 1) * tile * (rb(k) + sb(k) + rb(v) + sb(v))


def ptxas_resources(ptx_dir: str) -> tuple[dict, dict]:
    """({module: {kernel: [regs, smem]}}, {kernel: (spill stores, spill loads)}) from
    ptxas -arch=sm_90 -v on ptx_dir/*.ptx."""
    modules, spills = {}, {}
    entry = re.compile(r"Compiling entry function '(\w+)' for 'sm_90'(.*?)(?=Compiling entry|\Z)", re.S)
    for ptx in sorted(glob.glob(os.path.join(ptx_dir, "*.ptx"))):
        with tempfile.TemporaryDirectory() as tmp:
            res = subprocess.run(["ptxas", "-arch=sm_90", "-v", ptx, "-o", os.path.join(tmp, "a.cubin")],
                                 capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"ptxas failed on {ptx}:\n{res.stderr}")
        ks = {}
        for name, body in entry.findall(res.stderr):
            regs = re.search(r"Used (\d+) registers", body)
            smem = re.search(r"(\d+) bytes smem", body)
            sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
            ks[name] = [int(regs.group(1)) if regs else 0, int(smem.group(1)) if smem else 0]
            spills[name] = (int(sp.group(1)), int(sp.group(2))) if sp else (0, 0)
        modules[os.path.splitext(os.path.basename(ptx))[0]] = ks
    return modules, spills


def _natural(name: str) -> list:
    """d64 < d128 < d256 < dx."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def rows(modules: dict, spills: dict) -> list[dict]:
    out = []
    for module, kernels in sorted(modules.items()):
        for name, (regs, smem) in sorted(kernels.items(), key=lambda kv: _natural(kv[0])):
            m = SPLIT.match(name)
            if m:
                threads = 128
                fmt, d, gb = m.group(2), m.group(3), int(m.group(4))
                block = split_in_flight(fmt, 128 if d == "x" else int(d), gb)
            else:
                threads, block, _ = OTHERS.get(name, (128, 0, ""))
            n, limit = resident(regs, smem, threads)
            out.append({"module": module, "kernel": name, "regs": regs, "smem": smem,
                        "blocks": n, "limit": limit, "threads_sm": n * threads,
                        "block_bytes": block, "sm_bytes": n * block,
                        "spills": spills.get(name)})
    return out


def kib(n: int) -> str:
    return f"{n / 1024:g} KiB" if n else "-"


def markdown(table: list[dict]) -> str:
    """Split kernels two to a line (kv_attn_* / kv_pattn_*: GpuKVCache / GpuKVPool), the
    others one to a line."""
    spilled = any(r["spills"] for r in table)
    head = ("| kernel | registers | static smem | blocks/SM (limit) | threads/SM "
            "| in flight/block | in flight/SM |" + (" spills (st/ld B) |" if spilled else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    by_name = {r["kernel"]: r for r in table}
    for r in table:
        name = r["kernel"]
        if name.startswith("kv_pattn_"):
            continue
        pair = [r]
        if name.startswith("kv_attn_") and name != "kv_attn_merge":
            p = by_name.get("kv_p" + name[3:])
            if p is not None:
                pair.append(p)
                name = "kv_(p)attn_" + name[len("kv_attn_"):]

        def both(key, fmt=str):
            vals = [fmt(x[key]) for x in pair]
            return vals[0] if len(set(vals)) == 1 else " / ".join(vals)
        line = (f"| {name} | {both('regs')} | {r['smem']} | "
                f"{both('blocks')} ({both('limit')}) | {both('threads_sm')} | "
                f"{kib(r['block_bytes'])} | {both('sm_bytes', kib)} |")
        if spilled:
            line += f" {both('spills', lambda s: '%d/%d' % s if s and any(s) else '-')} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptx", metavar="DIR", help="run ptxas -arch=sm_90 -v on DIR/*.ptx instead "
                                                  "of reading cuda/resources.json")
    ap.add_argument("--format", choices=("markdown", "csv"), default="markdown")
    args = ap.parse_args()
    if args.ptx:
        modules, spills = ptxas_resources(args.ptx)
    else:
        with open(RESOURCES) as f:
            modules, spills = json.load(f)["modules"], {}
    table = rows(modules, spills)
    if args.format == "csv":
        print("module,kernel,registers,static_smem,blocks_per_sm,limit,threads_per_sm,"
              "in_flight_per_block,in_flight_per_sm")
        for r in table:
            print(",".join(str(r[k]) for k in ("module", "kernel", "regs", "smem", "blocks", "limit",
                                               "threads_sm", "block_bytes", "sm_bytes")))
    else:
        print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
