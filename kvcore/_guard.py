"""One call at a time: detects a second thread entering an object that takes one call at a
time (a KVCache, the paged pool) and refuses it, instead of letting the two race.

Kernels of large calls run without the GIL, so two threads appending to one cache would
otherwise write the same positions and count them twice (silent loss). Waiting for the
other thread would hide the bug in the caller (two threads driving one sequence), so the
guard never blocks: the second call raises StateError, having changed nothing.

    guard = CallGuard("KVCache")
    with guard("truncate"):            # StateError if another thread is inside
        ...

The hot path (one append per layer per decode step) inlines the same two lock calls, which
cost about 0.1 us, instead of the context manager's method calls:

    if not guard.acquire(False):
        guard.refuse("append")
    try:
        ...
    finally:
        guard.release()

The guard is not reentrant: a guarded method must not call another guarded method of the
same object (call the unguarded internals instead). A copy (copy.deepcopy, pickle) of a
guard is a fresh, unlocked guard: a lock is this process's and this object's own.
"""
from __future__ import annotations

import threading
from typing import NoReturn

from .errors import StateError


class CallGuard:
    """A non-blocking lock taken by every call that writes an object, and by each read that
    must not see a half-done write; `what` names the object in errors."""

    __slots__ = ("acquire", "release", "_what")

    def __init__(self, what: str):
        lock = threading.Lock()
        self.acquire = lock.acquire   # acquire(False): True when taken, False when busy
        self.release = lock.release
        self._what = what

    def refuse(self, op: str) -> NoReturn:
        raise StateError(f"{op}: this {self._what} is in use by another thread (it takes "
                         f"one call at a time: serialise the threads that share it, or give "
                         f"each its own)")

    def __reduce__(self) -> tuple[type["CallGuard"], tuple[str]]:
        """Copies and pickles as a fresh, unlocked guard of the same name."""
        return CallGuard, (self._what,)

    def __call__(self, op: str) -> "CallGuard":
        """Takes the guard for the `with` block that follows, or raises StateError."""
        if not self.acquire(False):
            self.refuse(op)
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.release()
