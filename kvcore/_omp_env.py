"""How kvcore's OpenMP workers wait between parallel calls: a short spin, then asleep,
unless the process chose otherwise.

libgomp spins its idle workers by default for 300,000 rounds (milliseconds) after each
parallel region; on a machine that other processes keep busy those spinning threads take
the cores the working ones need, and the demo's decode loop ran up to 56x slower than on
one thread. Asleep at once (OMP_WAIT_POLICY=PASSIVE), every region pays a wake-up, and a
decode step of small regions ran 1.9x slower than one thread on an idle machine.
SPINCOUNT rounds (tens to hundreds of microseconds) keep the workers of back-to-back
regions awake and give the cores back soon after (tools/bench_contention.py). The runtime
reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it loads, so `short_spin` runs before
kvcore's first compiled module that links it: it sets GOMP_SPINCOUNT only when the user
set neither variable and no OpenMP runtime is loaded yet (one runtime serves the whole
process: torch, imported first, brings its own and keeps its settings), and `restore`
takes the variable back out of os.environ once the runtime has read it, so child
processes and runtimes loaded later never see it.
"""
from __future__ import annotations

import os

_RUNTIMES = ("libgomp", "libiomp", "libomp")
SPINCOUNT = 10_000
_set_here = False
WAIT = "unknown"
"""str: how kvcore's workers wait (`python -m kvcore info` prints it)."""


def _runtime_loaded() -> str | None:
    """The path of an OpenMP runtime already mapped into this process, if any (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if any(name in os.path.basename(path) for name in _RUNTIMES):
                    return path
    except OSError:
        pass
    return None


def short_spin() -> None:
    """Sets GOMP_SPINCOUNT=SPINCOUNT for the runtime kvcore is about to load, unless the
    user chose a wait (OMP_WAIT_POLICY or GOMP_SPINCOUNT set) or a runtime is loaded."""
    global _set_here, WAIT
    chosen = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
              if k in os.environ]
    loaded = None if chosen else _runtime_loaded()
    if chosen:
        WAIT = f"as set by the user ({', '.join(chosen)})"
    elif loaded:
        WAIT = f"as set by the runtime loaded before kvcore ({loaded})"
    else:
        os.environ["GOMP_SPINCOUNT"] = str(SPINCOUNT)
        _set_here = True
        WAIT = f"spin {SPINCOUNT} rounds, then sleep (GOMP_SPINCOUNT, set by kvcore at import)"


def restore() -> None:
    """Removes what short_spin set from os.environ (the runtime has read it)."""
    global _set_here
    if _set_here and os.environ.get("GOMP_SPINCOUNT") == str(SPINCOUNT):
        del os.environ["GOMP_SPINCOUNT"]
    _set_here = False
