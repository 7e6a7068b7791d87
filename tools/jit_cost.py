#!/usr/bin/env python3
"""Times ptxas on each shipped PTX module: a lower bound of what the driver's JIT costs the
first time a process loads that module on a GPU whose JIT cache is cold (issue 27, item 7).

    python3 tools/jit_cost.py                 # ptxas -arch=sm_90, every cuda/*.ptx, one at a time
    python3 tools/jit_cost.py --arch sm_80 cuda/attention_q8_0.ptx

Prints a markdown table: module, PTX bytes, entries, ptxas wall seconds and CPU seconds
(user + system of the child, from getrusage: less sensitive than the wall time to other
load on the machine). The driver JIT does what ptxas does and more (it also links and
loads), so a device's first load takes at least this long; later processes hit the JIT
cache (~/.nv/ComputeCache) and pay none of it.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_ptxas(ptx: str, arch: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ptxas -arch=<arch> on ptx."""
    with tempfile.TemporaryDirectory() as tmp:
        cpu0, t0 = child_cpu(), time.perf_counter()
        res = subprocess.run(["ptxas", f"-arch={arch}", ptx, "-o", os.path.join(tmp, "m.cubin")],
                             capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, child_cpu() - cpu0
    if res.returncode != 0:
        sys.exit(f"ptxas failed on {ptx}:\n{res.stderr}")
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ptx", nargs="*", help="PTX files (default: cuda/*.ptx)")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    files = args.ptx or sorted(glob.glob(os.path.join(ROOT, "cuda", "*.ptx")))
    print(f"| module | PTX bytes | entries | ptxas -arch={args.arch} wall (s) | CPU (s) |")
    print("|---|---|---|---|---|")
    total_wall = total_cpu = 0.0
    for ptx in files:
        with open(ptx) as f:
            entries = len(re.findall(r"^\.visible \.entry|^\.entry", f.read(), re.M))
        wall, cpu = time_ptxas(ptx, args.arch)
        total_wall, total_cpu = total_wall + wall, total_cpu + cpu
        print(f"| {os.path.splitext(os.path.basename(ptx))[0]} | {os.path.getsize(ptx)} | {entries} "
              f"| {wall:.1f} | {cpu:.1f} |", flush=True)
    print(f"| all | | | {total_wall:.1f} | {total_cpu:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
