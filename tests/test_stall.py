"""The fork watchdog (peer/stall.py) and the exec that gets a peer out of a hung fork
(peer/daemon/restart.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch


def test_a_block_that_finishes_in_time_calls_nobody() -> None:
    from peer.stall import stall_watch

    calls: list[float] = []
    with stall_watch(0.3, "a quick thing", lambda: calls.append(time.monotonic())):
        time.sleep(0.05)
    time.sleep(0.5)  # past the limit: the watchdog must have gone quietly
    assert calls == []


def stuck_in_fork_like_call(release: threading.Event) -> None:
    """Stands for the parent that never leaves os.fork(): a named frame the dump must show."""
    release.wait(10)


def test_a_block_that_hangs_gets_every_stack_written_and_the_callback(capfd) -> None:
    from peer.stall import stall_watch

    release = threading.Event()
    called = threading.Event()

    def on_stall() -> None:
        called.set()
        release.set()  # what an exec does for real: the stuck block is over

    t0 = time.monotonic()
    with stall_watch(0.3, "forking the test process", on_stall):
        stuck_in_fork_like_call(release)
    assert called.is_set() and 0.25 < time.monotonic() - t0 < 5
    err = capfd.readouterr().err
    assert "anchormesh: forking the test process has not finished after" in err
    assert "stuck_in_fork_like_call" in err  # the stuck thread's own frame, for whoever reads the log


def test_exec_again_keeps_the_peer_s_id_and_key_and_runs_the_same_command(monkeypatch) -> None:
    from peer.daemon import restart
    from peer.daemon.startup import STARTED_ENV
    from peer.security.identity import IDENTITY_ENV

    # exec_again writes os.environ: a copy stands in for it, so nothing leaks into later tests'
    # subprocesses (every peer they start would take this id and key)
    monkeypatch.setattr(
        os,
        "environ",
        {k: v for k, v in os.environ.items() if k not in (restart.PEER_ID_ENV, STARTED_ENV, IDENTITY_ENV)},
    )
    monkeypatch.setattr(sys, "argv", ["anchormesh", "peer", "--tracker", "198.18.0.1:7000"])
    seen: list[tuple] = []

    class Execed(Exception):
        pass

    def fake_execv(path: str, args: list[str]) -> None:
        seen.append((path, args, dict(os.environ)))
        raise Execed

    monkeypatch.setattr(os, "execv", fake_execv)
    with pytest.raises(Execed):
        restart.exec_again("peer-7", "ab" * 32)
    path, args, env = seen[0]
    assert path == sys.executable and args == [sys.executable, "-m", "peer.cli", "peer", "--tracker", "198.18.0.1:7000"]
    assert env[restart.PEER_ID_ENV] == "peer-7" and env[IDENTITY_ENV] == "ab" * 32
    assert abs(float(env[STARTED_ENV]) - time.time()) < 60
    seen.clear()
    del os.environ[IDENTITY_ENV]
    with pytest.raises(Execed):
        restart.exec_again("peer-7", None)  # a state dir holds the key: none in the environment
    assert IDENTITY_ENV not in seen[0][2]


@pytest.mark.processes
def test_a_group_averager_whose_fork_never_returns_calls_for_help(monkeypatch) -> None:
    """The parent stuck in run_in_background past its own wait (a hung fork): `on_stuck` runs;
    here it unblocks the fake hang, and the averager then starts for real."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    from peer.dp import group, group_process

    real = DecentralizedAverager.run_in_background
    release = threading.Event()
    stuck: list[bool] = []

    def hangs_before_forking(self, await_ready: bool = True, timeout: float | None = None) -> None:
        if not stuck:
            release.wait(20)
        real(self, await_ready=await_ready, timeout=timeout)

    def on_stuck() -> None:
        stuck.append(True)
        release.set()

    monkeypatch.setattr(DecentralizedAverager, "run_in_background", hangs_before_forking)
    monkeypatch.setattr(group_process, "START_TIMEOUT_S", 0.5)
    monkeypatch.setattr(group_process, "FORK_STALL_S", 0.5)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        t0 = time.monotonic()
        avg = group.GroupAverager(
            dht, [torch.nn.Parameter(torch.zeros(4))], "test_stuck_fork", every=1, on_stuck=on_stuck
        )
        assert stuck == [True] and time.monotonic() - t0 < 15
        assert avg.averager.is_alive()
        avg.shutdown()
    finally:
        dht.shutdown()


ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`code` run by a fresh interpreter from the repository root (a watchdog may end it)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)


@pytest.mark.processes
def test_a_block_that_holds_the_gil_ends_the_process_with_every_stack_written() -> None:
    """The case the Python watchdog cannot catch (a parent stuck inside fork holds the GIL): a
    libc sleep called through ctypes.PyDLL keeps the GIL for its whole length."""
    code = (
        "import ctypes, time\n"
        "from peer.stall import stall_watch\n"
        "called = []\n"
        "with stall_watch(0.3, 'holding the GIL', lambda: called.append(1), exit_after_s=1.0):\n"
        "    ctypes.PyDLL(None).sleep(20)\n"
        "print('returned', called)\n"
    )
    t0 = time.monotonic()
    done = _python(code)
    assert done.returncode == 1 and time.monotonic() - t0 < 15, (done.returncode, done.stderr[-2000:])
    assert "returned" not in done.stdout
    assert (
        "has not finished after" not in done.stderr
    )  # the Python watchdog never got the GIL: only the C timer could act
    assert (
        "Timeout" in done.stderr and "<module>" in done.stderr
    )  # faulthandler's dump, from C, of the stuck main thread


@pytest.mark.processes
def test_a_block_that_finishes_disarms_the_exit() -> None:
    code = (
        "import time\n"
        "from peer.stall import stall_watch\n"
        "with stall_watch(5.0, 'a quick thing', lambda: None, exit_after_s=0.5):\n"
        "    pass\n"
        "time.sleep(1.5)\n"  # past exit_after_s
        "print('still here')\n"
    )
    done = _python(code)
    assert done.returncode == 0 and done.stdout.strip() == "still here", done.stderr[-2000:]


@pytest.mark.processes
def test_peers_leave_grpc_s_fork_handlers_off() -> None:
    """gRPC's prepare-fork handler waits on gRPC's threads with the GIL held (see peer/__init__.py)."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = _python("import bootstrap, os; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])", env)
    assert out.stdout.strip() == "0", out.stderr
    env["GRPC_ENABLE_FORK_SUPPORT"] = "1"
    out = _python("import peer, os; print(os.environ['GRPC_ENABLE_FORK_SUPPORT'])", env)
    assert out.stdout.strip() == "1", out.stderr
