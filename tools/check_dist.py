"""Builds kvcore's sdist and wheel and proves them as a user meets them.

    python tools/check_dist.py [--keep DIR] [--tests FILE ...]

1. `python -m build`: the sdist from this tree, then the wheel from the unpacked sdist
   (so the sdist alone must hold everything a build needs), each in an isolated build
   environment with only pyproject.toml's build requirements. The wheel's build is what
   `pip install kvcore-<v>.tar.gz` does before it installs the wheel it made (the same
   PEP 517 build_wheel of the unpacked sdist, in an isolated environment with the same
   requirements), so installing this wheel, in step 3, is installing the sdist: the one
   compilation proves both, and no second venv compiles the sdist again.
2. The sdist holds the Cython sources, the CUDA sources and PTX, the tests, docs and tools,
   and no built file; the wheel is tagged for this platform and holds every compiled
   extension, every CUDA file setup.py ships (kvcore/_cuda/: the PTX, the sources, the
   emulator's headers, resources.json) and py.typed.
3. In a new venv (no system site-packages, nothing from this tree), pip installs the wheel
   (its dependencies from the index), then, from a directory outside any source tree:
   `import kvcore` (from the venv), `python -m kvcore info`, `python -m kvcore demo --quick`,
   and a short test selection from the sdist's own tests (pytest, hypothesis and ml_dtypes
   installed beside it).

Prints one line per step and exits non-zero at the first failure, with its output.
"""
from __future__ import annotations

import argparse
import ast
import glob
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = ["tests/test_quant.py", "tests/test_cache.py", "tests/test_pool.py", "tests/test_cli.py"]
# every kvcore/_*.pyx of the source tree is an extension the wheel must hold
EXTENSIONS = sorted(os.path.basename(p)[:-4]
                    for p in glob.glob(os.path.join(ROOT, "kvcore", "_*.pyx")))


def _shipped_cuda() -> list[str]:
    """The files of cuda/ that setup.py ships as kvcore/_cuda/ (its CUDA_DATA patterns,
    read from setup.py itself), relative to cuda/."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    patterns, = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "CUDA_DATA" for t in node.targets)]
    cuda = os.path.join(ROOT, "cuda")
    return sorted({os.path.relpath(p, cuda) for pattern in patterns
                   for p in glob.glob(os.path.join(cuda, pattern)) if os.path.isfile(p)})


CUDA_SHIPPED = _shipped_cuda()
SDIST_MUST_HOLD = ["setup.py", "pyproject.toml", "MANIFEST.in", "README.md",
                   "kvcore/_cache.pyx", "kvcore/_quant.pxd", "kvcore/_parallel.pxd",
                   "kvcore/_cpu.pyx", "kvcore/_attention.pyx", "kvcore/_f16_prefetch.h",
                   "kvcore/py.typed",
                   "cuda/attention.cuh", "cuda/kv_append.ptx", "cuda/emu/kvemu.h",
                   "tests/conftest.py", "docs/design.md", "tools/check_dist.py"]


def run(step: str, argv: list[str], **kw) -> str:
    """Runs argv; prints the step and its time; exits with its output when it fails."""
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True, **kw)
    print(f"{step}: {'ok' if res.returncode == 0 else 'FAILED'} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    if res.returncode != 0:
        sys.exit(f"{' '.join(argv)} exited {res.returncode}\n{res.stdout[-8000:]}\n{res.stderr[-8000:]}")
    return res.stdout


def fail(msg: str) -> None:
    sys.exit(f"FAILED: {msg}")


def check_sdist(path: str) -> None:
    with tarfile.open(path) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    missing = [n for n in SDIST_MUST_HOLD if n not in names]
    built = [n for n in names if n.endswith((".so", ".pyd")) or
             (n.startswith("kvcore/") and n.endswith(".c")) or "__pycache__" in n]
    if missing or built:
        fail(f"sdist {os.path.basename(path)}: missing {missing}, built files {built}")
    print(f"sdist: {len(names)} entries, every required file, no built file", flush=True)


def check_wheel(path: str) -> None:
    name = os.path.basename(path)
    if name.endswith("-none-any.whl"):
        fail(f"wheel {name} is tagged pure Python: it holds no compiled extension")
    with zipfile.ZipFile(path) as whl:
        names = whl.namelist()
    exts = sorted(n.split("/")[1].split(".")[0] for n in names
                  if n.startswith("kvcore/_") and n.endswith((".so", ".pyd")))
    cuda = sorted(n[len("kvcore/_cuda/"):] for n in names if n.startswith("kvcore/_cuda/"))
    ptx = [n for n in cuda if n.endswith(".ptx")]
    lacking = sorted(set(CUDA_SHIPPED) - set(cuda))
    if exts != EXTENSIONS or not ptx or lacking or "kvcore/py.typed" not in names:
        fail(f"wheel {name}: extensions {exts} (want {EXTENSIONS}), {len(ptx)} PTX files, "
             f"lacking CUDA files {lacking}, py.typed {'kvcore/py.typed' in names}")
    print(f"wheel: {name}, extensions {' '.join(exts)}, {len(ptx)} PTX files, "
          f"{len(cuda)} files under kvcore/_cuda/", flush=True)


def check(work: str, tests: list[str]) -> None:
    dist = os.path.join(work, "dist")
    run("python -m build (sdist, then the wheel from it)",
        [sys.executable, "-m", "build", "--outdir", dist, ROOT], cwd=work)
    sdist, = glob.glob(os.path.join(dist, "*.tar.gz"))
    wheel, = glob.glob(os.path.join(dist, "*.whl"))
    check_sdist(sdist)
    check_wheel(wheel)

    # a new venv with the wheel built from the sdist: what `pip install` of either installs
    venv = os.path.join(work, "venv")
    run("a new venv", [sys.executable, "-m", "venv", venv])
    py = os.path.join(venv, "bin", "python")
    run("pip install the wheel built from the sdist", [py, "-m", "pip", "install", "-q", wheel])
    elsewhere = os.path.join(work, "elsewhere")   # no kvcore/ here: imports find the venv's
    os.makedirs(elsewhere, exist_ok=True)
    where = run("import kvcore", [py, "-c", "import kvcore; print(kvcore.__file__)"],
                cwd=elsewhere).strip()
    if not os.path.realpath(where).startswith(os.path.realpath(venv)):
        fail(f"import kvcore found {where}, not the copy in {venv}")
    print(run("python -m kvcore info", [py, "-m", "kvcore", "info"], cwd=elsewhere)
          .splitlines()[1], flush=True)
    demo = run("python -m kvcore demo --quick", [py, "-m", "kvcore", "demo", "--quick"],
               cwd=elsewhere)
    print(demo.splitlines()[0], flush=True)

    run("pip install pytest, hypothesis, ml_dtypes",
        [py, "-m", "pip", "install", "-q", "pytest>=8", "hypothesis>=6.100", "ml_dtypes>=0.4"])
    unpacked = os.path.join(work, "sdist")
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    src, = glob.glob(os.path.join(unpacked, "kvcore-*"))
    out = run(f"pytest {' '.join(tests)} (the sdist's tests, the installed wheel)",
              [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", src,
               *[os.path.join(src, t) for t in tests]], cwd=elsewhere)
    print(out.strip().splitlines()[-1], flush=True)
    print(f"dist check passed: {os.path.basename(sdist)}, {os.path.basename(wheel)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", help="work in this directory and keep it (default: a "
                                       "temporary one, removed at the end)")
    parser.add_argument("--tests", nargs="*", default=TESTS,
                        help=f"the sdist's test files to run against the installed wheel "
                             f"(default: {' '.join(TESTS)})")
    args = parser.parse_args()
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        check(args.keep, args.tests)
    else:
        with tempfile.TemporaryDirectory(prefix="kvcore-dist-") as work:
            check(work, args.tests)


if __name__ == "__main__":
    main()
