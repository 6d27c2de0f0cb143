"""A watchdog for a block that may never return (a fork beside live threads): it writes every
thread's stack and calls for help instead of leaving the process hung in silence.

Two watchdogs, because a Python thread runs only while the stuck thread has let go of the GIL:
CPython calls fork() holding it, so a parent stuck inside fork itself (seen: the main
thread in popen_fork._launch for minutes, the Python watchdog still waiting) is caught only by
the second, faulthandler's C thread, which needs no GIL but can only write the stacks and exit
(status 1): a dead peer is one the tracker routes around and a supervisor (docker's
`restart: on-failure`) starts again, where a hung one holds its stage and answers nobody."""

from __future__ import annotations

import faulthandler
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _say(text: str) -> None:
    """Straight to fd 2: the stuck thread may hold the logging module's lock (logging takes it
    before every fork), so the watchdog must not go through `logging`."""
    os.write(2, text.encode("utf-8", "replace"))


@contextmanager
def stall_watch(
    limit_s: float, what: str, on_stall: Callable[[], None], exit_after_s: float | None = None
) -> Iterator[None]:
    """Run the block; if it has not finished after `limit_s`, write every thread's stack to stderr
    (so the cause can be found) and call `on_stall` from the watchdog thread. With
    `exit_after_s`, a block still running then (with the GIL held, `on_stall` could not run) gets
    the stacks written from C and the process ended with status 1. faulthandler keeps one such
    timer per process: this one replaces any other while the block runs."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(limit_s):
            return
        _say(f"anchormesh: {what} has not finished after {limit_s:.0f}s; every thread's stack follows\n")
        faulthandler.dump_traceback(
            file=2, all_threads=True
        )  # fd 2 too: sys.stderr may be a wrapper without a file number
        on_stall()

    threading.Thread(target=watch, name=f"stall-watch {what}", daemon=True).start()
    if exit_after_s is not None:
        faulthandler.dump_traceback_later(exit_after_s, exit=True, file=2)
    try:
        yield
    finally:
        done.set()
        if exit_after_s is not None:
            faulthandler.cancel_dump_traceback_later()
