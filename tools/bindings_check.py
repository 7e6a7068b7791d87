"""Runs kvcore's gpu tests against another release of cuda-python's driver bindings than the
installed one (by default the oldest the `[cuda]` extra allows): the release is installed
into a temporary directory put first on PYTHONPATH, so it shadows the installed one for the
child pytest only.

    python3 tools/bindings_check.py tests/test_emu_driver.py -q          # the oldest: OLDEST
    python3 tools/bindings_check.py --bindings 13.0.0 tests/test_gpu_cache.py -q

Every other argument goes to pytest; the exit status is pytest's (2 when the install fails).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLDEST = "12.9.0"   # pyproject.toml: cuda = ["cuda-bindings>=12.9,<14"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bindings", default=OLDEST, help=f"the cuda-bindings release (default {OLDEST})")
    args, pytest_args = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcore-bindings-") as target:
        install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                                  "--disable-pip-version-check", "--target", target,
                                  f"cuda-bindings=={args.bindings}"], capture_output=True, text=True)
        if install.returncode != 0:
            print(f"installing cuda-bindings=={args.bindings} failed:\n{install.stderr[-4000:]}")
            return 2
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (target, ROOT, os.environ.get("PYTHONPATH")) if p))
        probe = subprocess.run([sys.executable, "-c", "import cuda.bindings as b; print(b.__version__)"],
                               env=env, capture_output=True, text=True)
        if probe.stdout.strip() != args.bindings:
            print(f"cuda-bindings {args.bindings} was installed, but the child imports "
                  f"{probe.stdout.strip() or probe.stderr.strip()[-500:]}")
            return 2
        print(f"cuda-bindings {args.bindings} (from {target})", flush=True)
        return subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
