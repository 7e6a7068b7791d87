# cython: language_level=3
"""The instruction sets kvcore's kernels were built for, against the CPU that runs them.

The kernel extensions (_quant, _cache, _attention, _parallel) are compiled for one target
(setup.py: -march=native, or $KVCORE_MARCH): on a CPU without one of its instructions
(a wheel built on an AVX-512 machine, run on an AVX2 one) they would die with SIGILL on
import or on first use. This module is compiled for the compiler's baseline, so it runs
anywhere; `kvcore/__init__.py` calls `check()` before any kernel module is imported.

KVCORE_TARGET_ISA (set by setup.py) lists the target's x86 features by the names of
`__builtin_cpu_supports`, space-separated; empty on other architectures, where nothing
is checked.
"""

cdef extern from *:
    """
    #include <string.h>
    #ifndef KVCORE_TARGET_ISA
    #define KVCORE_TARGET_ISA ""
    #endif
    #if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
    #define KV_HAS(name) (__builtin_cpu_supports(name) != 0)
    static int kvcore_cpu_has(const char* f) {
        __builtin_cpu_init();
        /* __builtin_cpu_supports takes string literals only: one line per feature that
           setup.py may name (FEATURES there) */
        if (!strcmp(f, "sse4.2")) return KV_HAS("sse4.2");
        if (!strcmp(f, "avx")) return KV_HAS("avx");
        if (!strcmp(f, "avx2")) return KV_HAS("avx2");
        if (!strcmp(f, "fma")) return KV_HAS("fma");
        if (!strcmp(f, "f16c")) return KV_HAS("f16c");
        if (!strcmp(f, "bmi")) return KV_HAS("bmi");
        if (!strcmp(f, "bmi2")) return KV_HAS("bmi2");
        if (!strcmp(f, "avx512f")) return KV_HAS("avx512f");
        if (!strcmp(f, "avx512bw")) return KV_HAS("avx512bw");
        if (!strcmp(f, "avx512vl")) return KV_HAS("avx512vl");
        if (!strcmp(f, "avx512dq")) return KV_HAS("avx512dq");
        if (!strcmp(f, "avx512cd")) return KV_HAS("avx512cd");
        if (!strcmp(f, "avx512vnni")) return KV_HAS("avx512vnni");
        if (!strcmp(f, "avx512bf16")) return KV_HAS("avx512bf16");
        return -1;   /* a name this build cannot ask about */
    }
    #else
    static int kvcore_cpu_has(const char* f) { (void)f; return -1; }
    #endif
    """
    const char* KVCORE_TARGET_ISA
    int kvcore_cpu_has(const char* f)


def target() -> list[str]:
    """The x86 features the kernels were compiled for ([] on other architectures)."""
    return KVCORE_TARGET_ISA.decode().split()


def missing() -> list[str]:
    """The target's features this CPU lacks (features it cannot ask about count as present)."""
    return [f for f in target() if kvcore_cpu_has(f.encode()) == 0]


def explain(lacking: list[str]) -> str:
    """The message of `check` for a CPU that lacks `lacking`."""
    return (f"this build of kvcore was compiled for a CPU with {' '.join(target())}, and this "
            f"CPU lacks {' '.join(lacking)}: its kernels would stop the process with an illegal "
            "instruction. Build kvcore on this machine (pip install --no-binary kvcore kvcore, "
            "or pip install . in a checkout), or build a portable wheel with "
            "KVCORE_MARCH=x86-64-v3 (AVX2, FMA, F16C: x86 CPUs since 2013-2015)")


def check() -> None:
    """ImportError (explain()) when this CPU lacks a feature the kernels need."""
    lacking = missing()
    if lacking:
        raise ImportError(explain(lacking))
