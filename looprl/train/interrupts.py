"""Ctrl-C and SIGTERM during `looprl train` (DESIGN.md §6; the run's outputs stay resumable).

Two phases, two context managers, both active in the main thread only (elsewhere they do
nothing, as Python delivers signals to the main thread):

- `CtrlC`, over the whole run: a SIGINT raises KeyboardInterrupt at once (the warm start and the
  evaluations stop where they are) and is remembered. Python drops an exception raised inside a
  garbage-collector callback or a `__del__` ("Exception ignored in ..."), and jax runs such a
  callback at every collection (`_xla_gc_callback`), so a Ctrl-C landing there used to be lost
  and the run went on to exit 0. `CtrlC.check()`, called after every warm-start step, every
  evaluation batch and between the run's phases, raises a remembered one again, and the
  traceback Python would print for the dropped one is left out (`sys.unraisablehook`).
- `DeferredSignals`, over the GRPO loop: SIGTERM and a first SIGINT only set `received`, so the
  loop finishes its step and writes a checkpoint; a second SIGINT aborts at once (exit status
  130, one line on stderr, no traceback; the checkpoints already written are complete, as
  every write is atomic).

Each restores the previous handlers on exit. A SIGINT the process inherited as ignored (a
background job of a shell script) stays ignored.
"""
from __future__ import annotations

import os
import signal
import sys
import threading


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install(sig, handler):
    """`signal.signal(sig, handler)` unless sig is ignored; returns what to restore (None:
    nothing was installed). A previous handler installed outside Python (getsignal None)
    is restored as the default one."""
    prev = signal.getsignal(sig)
    if prev is signal.SIG_IGN:
        return None
    signal.signal(sig, handler)
    if prev is None:
        prev = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
    return prev


class CtrlC:
    """While active, SIGINT raises KeyboardInterrupt and sets `pending` (the signal number);
    `check()` raises KeyboardInterrupt whenever `pending` is set. A KeyboardInterrupt Python
    drops as unraisable is not printed (other unraisables go to the previous hook)."""

    def __enter__(self):
        self.pending = None
        self._prev = self._prev_hook = None
        if _in_main_thread():  # one main thread: nested uses exit in LIFO order
            self._prev_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
            self._prev = _install(signal.SIGINT, self._raise)
        return self

    def _unraisable(self, unraisable):
        if not (self.pending is not None and unraisable.exc_type is KeyboardInterrupt):
            self._prev_hook(unraisable)

    def _raise(self, signum, frame):
        self.pending = signum
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if a SIGINT arrived (it may have been dropped on its way).
        Raises: KeyboardInterrupt."""
        if self.pending is not None:
            raise KeyboardInterrupt

    def tick(self, bar=None):
        """A `progress(n)` callback: `check()`, then `bar.update(n)` when a bar is given."""
        def progress(n: int) -> None:
            self.check()
            if bar is not None:
                bar.update(n)
        return progress

    def __exit__(self, exc_type, exc, tb):
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)
        if self._prev_hook is not None:
            sys.unraisablehook = self._prev_hook
        if (self.pending is not None and exc is not None
                and not isinstance(exc, KeyboardInterrupt) and _from_interrupt(exc)):
            # Python wraps a KeyboardInterrupt raised in some hooks (a dataclass field's
            # __set_name__ while a module imports): the Ctrl-C is still a Ctrl-C
            raise KeyboardInterrupt from exc
        return False


def _from_interrupt(exc: BaseException) -> bool:
    """True when a KeyboardInterrupt is in `exc`'s chain of causes and contexts."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class DeferredSignals:
    """While active, SIGTERM and a first SIGINT set `received` (the signal number) instead of
    interrupting; a second SIGINT ends the process at once with `os._exit(130)`."""

    def __enter__(self):
        self.received = None
        self._prev = {}
        if _in_main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                prev = _install(sig, self._handle)
                if prev is not None:
                    self._prev[sig] = prev
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.received is not None:
            print("looprl train: second Ctrl-C: aborting now, without a checkpoint of the "
                  "current step", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGINT)
        if self.received is None and signum == signal.SIGINT:
            print("\nlooprl train: Ctrl-C: finishing this GRPO step, then a checkpoint (Ctrl-C "
                  "again aborts at once)", file=sys.stderr, flush=True)
        self.received = self.received or signum

    def __exit__(self, *exc):
        for sig, prev in self._prev.items():
            signal.signal(sig, prev)
        return False
