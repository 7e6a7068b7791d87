"""Builds kvcore's Cython extensions (every kvcore/_*.pyx) with -O3 and OpenMP.

OpenMP is used when the compiler accepts -fopenmp; otherwise the prange loops run
serially (Cython compiles them without OpenMP) and `python -m kvcore info` says so.

The target CPU is the building machine's (-march=native): right for `pip install` from
source, which builds on the machine that runs it. A wheel for other machines needs a
target they all have; the environment variable KVCORE_MARCH names it:

    KVCORE_MARCH=x86-64-v3 python -m build --wheel    # AVX2, FMA, F16C: a portable wheel
    KVCORE_MARCH=x86-64-v3 python setup.py build_ext --inplace --force   # an AVX2 build here

(KVCORE_MARCH=none passes no -march at all: the compiler's baseline, SSE2 on x86-64.)
The x86 features of the target are recorded in kvcore._cpu, which is compiled for the
baseline and refuses, at `import kvcore`, a CPU that lacks one (an ImportError that says
so, instead of an illegal instruction).
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


# The x86 features kvcore._cpu can ask the CPU about (__builtin_cpu_supports names), by
# the macro a compiler defines when it targets them.
FEATURES = {"__SSE4_2__": "sse4.2", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma",
            "__F16C__": "f16c", "__BMI__": "bmi", "__BMI2__": "bmi2",
            "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl",
            "__AVX512DQ__": "avx512dq", "__AVX512CD__": "avx512cd",
            "__AVX512VNNI__": "avx512vnni", "__AVX512BF16__": "avx512bf16"}


def _target_features(arch: list[str]) -> list[str]:
    """The FEATURES the compiler targets with these flags (its predefined macros)."""
    cc = os.environ.get("CC", "cc")
    res = subprocess.run([cc, *arch, "-dM", "-E", "-x", "c", os.devnull],
                         capture_output=True, text=True)
    macros = {line.split()[1] for line in res.stdout.splitlines() if line.startswith("#define ")}
    return [name for macro, name in FEATURES.items() if macro in macros]


ARCH = _arch()
COMPILE = ["-O3", "-fno-strict-aliasing", "-ffp-contract=off"] + ARCH + (["-fopenmp"] if OPENMP else [])
LINK = ["-fopenmp"] if OPENMP else []
SOURCES = sorted(glob.glob("kvcore/_*.pyx"))
if "kvcore/_cache.pyx" not in SOURCES:
    # a source tree without the Cython sources (an incomplete sdist) must not build a wheel
    # that installs and then fails at import
    raise SystemExit(f"setup.py: kvcore/_cache.pyx not found under {os.getcwd()}: kvcore's "
                     "Cython sources (kvcore/_*.pyx, *.pxd) are missing from this source tree")


def _extension(path: str) -> Extension:
    name = os.path.splitext(os.path.basename(path))[0]
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
              ("KVCORE_OPENMP", "1" if OPENMP else "0")]
    if name == "_cpu":   # the baseline: it must run on a CPU that lacks the target
        isa = " ".join(_target_features(ARCH))
        return Extension("kvcore._cpu", [path], define_macros=[("KVCORE_TARGET_ISA", f'"{isa}"')],
                         extra_compile_args=["-O2"])
    return Extension("kvcore." + name, [path], include_dirs=[np.get_include()],
                     define_macros=macros, extra_compile_args=COMPILE, extra_link_args=LINK)


extensions = [_extension(path) for path in SOURCES]


# What ships under kvcore/_cuda/: the PTX the driver loads, and the CUDA sources with the
# emulator's headers (cuda/emu/), from which kvcore.gpu.use_emulator() builds the CPU kernels,
# and resources.json (ptxas' registers and shared memory per kernel, for the emulator).
CUDA_DATA = ["*.ptx", "*.cu", "*.cuh", "resources.json", "emu/*"]


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
