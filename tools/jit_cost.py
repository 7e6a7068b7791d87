#!/usr/bin/env python3
"""What the driver's JIT costs on a cold cache, bounded from below by ptxas for sm_90 (the
JIT compiles the same PTX): per shipped module, the CPU seconds of ptxas over the whole
module (what loading it whole costs) and over one kernel cut out of it (what kvcore loads:
kernels.py, _ptx.entry_image), with the bytes of each.

    python3 tools/jit_cost.py                      # every module; 2 kernels of each
    python3 tools/jit_cost.py attention_q8_0 --kernels 4

Prints a markdown table; CPU seconds (user + system of the ptxas child), so a busy machine
changes them little. Needs ptxas on PATH.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvcore.gpu import _ptx  # noqa: E402


def ptxas_seconds(text: bytes, arch: str) -> float:
    """CPU seconds of `ptxas -arch=<arch>` over the PTX text."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "m.ptx")
        with open(src, "wb") as f:
            f.write(text)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(["ptxas", f"-arch={arch}", "-o", os.path.join(d, "m.cubin"), src], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help="module names (default: every cuda/*.ptx)")
    ap.add_argument("--kernels", type=int, default=2, help="kernels cut out per module (default 2)")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    if shutil.which("ptxas") is None:
        print("ptxas is not on PATH")
        return 2
    cuda = os.path.join(ROOT, "cuda")
    names = args.modules or sorted(f[:-4] for f in os.listdir(cuda) if f.endswith(".ptx"))
    print(f"| module | kernels | whole: bytes | whole: ptxas {args.arch} CPU s | one kernel: bytes | "
          f"one kernel: ptxas CPU s (each of {args.kernels}) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        with open(os.path.join(cuda, name + ".ptx"), "rb") as f:
            text = f.read()
        entries = list(_ptx.parse(text).entries)
        whole = ptxas_seconds(text, args.arch)
        picked = [k for k in entries if "_d128_g8" in k][:args.kernels] or entries[:args.kernels]
        cuts = [_ptx.entry_image(text, k) for k in picked]
        secs = [ptxas_seconds(c, args.arch) for c in cuts]
        print(f"| {name} | {len(entries)} | {len(text)} | {whole:.1f} | "
              f"{' / '.join(str(len(c)) for c in cuts)} | {' / '.join(f'{s:.2f}' for s in secs)} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
