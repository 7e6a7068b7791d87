"""python -m kvcore demo | info"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np

import kvcore

from . import _omp_env
from ._cache import build_info
from ._demo import print_table


def info() -> None:
    """Version, build, threads, formats, and what the GPU layer finds."""
    b = build_info()
    print(f"kvcore {kvcore.__version__}  (python {sys.version.split()[0]}, numpy {np.__version__})")
    print(f"build: {b['compiler']}, {'-O3' if b['optimized'] else 'not optimised'}, "
          f"OpenMP {'on' if kvcore.openmp_enabled() else 'off (serial kernels)'}, "
          f"ISA targeted: {' '.join(b['isa']) or 'baseline'}")
    print(f"threads: {kvcore.max_threads()} (of {os.cpu_count()} CPUs; "
          "kvcore.set_num_threads to change; fewer run while other processes keep the "
          f"CPUs busy); OpenMP workers wait: {_omp_env.WAIT}")
    ml = importlib.util.find_spec("ml_dtypes") is not None
    print(f"ml_dtypes: {'installed (bf16/fp8 views)' if ml else 'not installed (raw uint views)'}")
    rows = []
    for f in kvcore.FORMATS.values():
        rows.append([f.name, f.id, str(f.code_dtype), str(f.scale_dtype or "-"),
                     f.scales_per_row(128), f.row_bytes(128), f"{512 / f.row_bytes(128):.2f}"])
    print_table(["format", "id", "code dtype", "scale dtype", "scales/row", "bytes/row",
                 "ratio vs f32"], rows, title="formats (per head row, head_dim 128)")
    cuda = importlib.util.find_spec("cuda") is not None
    try:
        from .gpu import is_available
        device = "present" if is_available() else "none usable"
    except ImportError as e:
        device = f"unknown (kvcore.gpu did not import: {e})"
    print(f"\ncuda-python: {'importable' if cuda else 'not installed'}; GPU: {device}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcore",
                                     description="kvcore: the key/value cache of transformer decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="fill a model-shaped cache in every format; time, check, error")
    demo.add_argument("--quick", action="store_true",
                      help="every part at a few seconds' size (4 layers, 512 positions)")
    demo.add_argument("--threads", type=int, metavar="N",
                      help="kvcore's threads (kvcore.set_num_threads; default: every CPU)")
    sub.add_parser("info", help="version, build flags, threads, formats, GPU")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import _demo
        if args.threads is not None:
            try:
                kvcore.set_num_threads(args.threads)
            except kvcore.KVCacheError as e:
                parser.error(f"--threads {args.threads}: {e}")
        _demo.main(_demo.QUICK if args.quick else _demo.FULL)
    else:
        info()
    return 0


if __name__ == "__main__":
    sys.exit(main())
