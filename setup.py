"""Builds kvcore's Cython extensions (every kvcore/_*.pyx) with -O3 and OpenMP.

OpenMP is used when the compiler accepts -fopenmp; otherwise the prange loops run
serially (Cython compiles them without OpenMP) and `python -m kvcore info` says so.

The target CPU is the building machine's (-march=native). The environment variable
KVCORE_MARCH names another -march target, e.g. an AVX2-only build of the same source:

    KVCORE_MARCH=x86-64-v3 python setup.py build_ext --inplace --force

(KVCORE_MARCH=none passes no -march at all: the compiler's baseline, SSE2 on x86-64.)
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py


def _compiler_accepts_openmp() -> bool:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        cmd = [cc, "-fopenmp", src, "-o", os.path.join(tmp, "t")]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def _compiler_accepts(flag: str) -> bool:
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("int main(void){return 0;}\n")
        cmd = [cc, flag, src, "-o", os.path.join(tmp, "t")]
        return shutil.which(cc) is not None and subprocess.run(cmd, capture_output=True).returncode == 0


# kvcore is built from source on the machine that runs it (pip install), so it targets
# that CPU (AVX2/F16C where present). -ffp-contract=off keeps every encoder's arithmetic
# exactly the documented rule (no fused multiply-add behind the source's back).
OPENMP = sys.platform != "win32" and _compiler_accepts_openmp()
def _arch() -> list[str]:
    """-march=$KVCORE_MARCH (refused when the compiler does not take it), else -march=native
    where the compiler takes it."""
    march = os.environ.get("KVCORE_MARCH", "").strip()
    if march == "none":
        return []
    if march:
        if not _compiler_accepts(f"-march={march}"):
            raise SystemExit(f"KVCORE_MARCH={march}: the compiler refuses -march={march}")
        return [f"-march={march}"]
    return ["-march=native"] if _compiler_accepts("-march=native") else []


ARCH = _arch()
COMPILE = ["-O3", "-fno-strict-aliasing", "-ffp-contract=off"] + ARCH + (["-fopenmp"] if OPENMP else [])
LINK = ["-fopenmp"] if OPENMP else []

extensions = [
    Extension(
        "kvcore." + os.path.splitext(os.path.basename(path))[0],
        [path],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                       ("KVCORE_OPENMP", "1" if OPENMP else "0")],
        extra_compile_args=COMPILE,
        extra_link_args=LINK,
    )
    for path in sorted(glob.glob("kvcore/_*.pyx"))
]


# What ships under kvcore/_cuda/: the PTX the driver loads, and the CUDA sources with the
# emulator's headers (cuda/emu/), from which kvcore.gpu.use_emulator() builds the CPU kernels.
CUDA_DATA = ["*.ptx", "*.cu", "*.cuh", "emu/*"]


class BuildPyWithPTX(build_py):
    """Ships cuda/ (CUDA_DATA) inside the package as kvcore/_cuda/."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "kvcore", "_cuda")
        for pattern in CUDA_DATA:
            for path in glob.glob(os.path.join("cuda", pattern)):
                if os.path.isfile(path):
                    dest = os.path.join(target, os.path.relpath(path, "cuda"))
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    shutil.copy(path, dest)


setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "nonecheck": False,
            "embedsignature": True,
        },
        compile_time_env={"KVCORE_OPENMP": OPENMP},
    ),
    cmdclass={"build_py": BuildPyWithPTX},
)
