"""Child processes die with their parent: a SIGKILLed peer or bootstrap leaves no p2pd or
hivemind process behind.

Why: hivemind's DHT and averager are `multiprocessing` children (forked), and the DHT child
starts the `p2pd` Go daemon (asyncio `create_subprocess_exec`, under uvloop). A parent killed
with SIGKILL runs no cleanup, so all of them lived on for good. `install()` makes every child
ask the kernel for SIGKILL when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`):

- forked Python children (multiprocessing), through an `os.register_at_fork` hook;
- asyncio subprocesses (p2pd), through a `preexec_fn` that hivemind's call does not pass.

The signal fires when the parent *thread* that forked exits, not the process. So it is asked
only for children forked by a main thread, which lives as long as its process (hivemind forks
its DHT and averager from the caller's thread, the main one in `anchormesh peer`/`bootstrap`,
and starts p2pd from the DHT child's main thread). A child forked from another thread is left
as before rather than killed when that thread ends. Elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import ctypes
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl: Callable[..., int] | None = None  # bound before any fork: the child only calls it
_installed = False
_fork_from_main = False  # set in the parent just before a fork, read in the child
_fork_parent = 0


def die_with_parent(parent_pid: int) -> None:
    """In a fresh child: SIGKILL me when my parent dies (and now, if it already has)."""
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died between fork and prctl: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def _before_fork() -> None:
    global _fork_from_main, _fork_parent
    _fork_from_main = threading.current_thread() is threading.main_thread()
    _fork_parent = os.getpid()


def _after_fork_in_child() -> None:
    if _fork_from_main:
        die_with_parent(_fork_parent)


def _guard_asyncio_exec(original: Callable) -> Callable:
    """`create_subprocess_exec` with a `preexec_fn` that ties the child to this thread's life,
    when called from a main thread and no `preexec_fn` is given."""

    @functools.wraps(original)
    async def create_subprocess_exec(program, *args, **kwargs):
        if kwargs.get("preexec_fn") is None and threading.current_thread() is threading.main_thread():
            kwargs["preexec_fn"] = functools.partial(die_with_parent, os.getpid())
        return await original(program, *args, **kwargs)

    create_subprocess_exec.__anchormesh_guard__ = True  # type: ignore[attr-defined]
    return create_subprocess_exec


def install() -> bool:
    """Once per process, before any child starts. Returns whether the guard is active."""
    global _installed, _prctl
    if _installed:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        _prctl = libc.prctl
        _prctl.restype = ctypes.c_int
    except (OSError, AttributeError) as exc:
        log.warning("children will not be tied to this process (no prctl: %s): a SIGKILL may leave them running", exc)
        return False
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    if not getattr(asyncio.subprocess.create_subprocess_exec, "__anchormesh_guard__", False):
        guarded = _guard_asyncio_exec(asyncio.subprocess.create_subprocess_exec)
        asyncio.subprocess.create_subprocess_exec = guarded  # hivemind's p2p_daemon calls it by this path
        asyncio.create_subprocess_exec = guarded
    _installed = True
    return True
