"""Shared pieces of the real-process swarm tests: a tiny run.toml and status polling.

Why a module: the churn, checkpoint and tracker-restart tests all start a bootstrap and peers on
the same tiny 2-stage model and wait on `anchormesh status --json`; on timeout every peer dumps
its threads' stacks (SIGUSR1) into its log, which the failure message then shows.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

TINY_RUN = """
[model]
name = "tiny-llama"
num_stages = 2
hidden_size = 32
num_layers = 2
num_heads = 2
max_seq_len = 32
[codec]
scheme = "lowrank"
[codec.lowrank]
rank = 8
[pipeline]
max_staleness = 0
micro_batch_size = 4
micro_batches = 2
seq_len = 32
eval_every = 0
"""
TOKENS_PER_STEP = 2 * 4 * 32  # micro_batches * micro_batch_size * seq_len of TINY_RUN
_LISTENERS: list[socket.socket] = []


def listening_address(host: str = "127.0.0.1") -> str:
    """`host:port` of a TCP socket that listens until the test process ends: what a fake peer
    announces at Join, so the tracker's dial-back (bootstrap/dial_back.py) finds it answering."""
    s = socket.socket()
    s.bind((host, 0))
    s.listen(16)
    _LISTENERS.append(s)
    return f"{host}:{s.getsockname()[1]}"


def tiny_run_toml(extra: str = "", top: str = "") -> str:
    """TINY_RUN with top-level keys (`top`) before it and more sections (`extra`) after it."""
    return top + TINY_RUN + extra


def status_json(tracker: str, *extra: str) -> dict | None:
    """`anchormesh status --json [EXTRA...]`, or None while the tracker does not answer."""
    out = subprocess.run(
        [sys.executable, "-m", "peer.cli", "status", "--tracker", tracker, "--json", *extra],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(out.stdout) if out.returncode == 0 else None


def logs(tmp: Path, tail: int = 4000) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-tail:]}" for f in sorted(tmp.glob("*.log")))


def wait_for_status(
    tracker: str,
    what: Callable[[dict], bool],
    tmp: Path,
    procs: Iterable[subprocess.Popen] = (),
    timeout: float = 120.0,
    extra: tuple[str, ...] = (),
) -> dict:
    """The first status for which `what` holds (`extra`: more `status` flags); on timeout the test
    fails with the last status, after each live peer process dumped its stacks into its log."""
    deadline, s = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        s = status_json(tracker, *extra)
        if s is not None and what(s):
            return s
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None and "peer" in p.args:
            p.send_signal(signal.SIGUSR1)
    time.sleep(2)
    pytest.fail(f"timed out; last status {json.dumps(s)[:1500]}\n{logs(tmp)}")


def admit(daemon, run_id: str, caller_id: str = "caller", rate: float = 1e6):
    """An in-process PeerDaemon set up as if its tracker had admitted it to `run_id` (no rate
    limits unless `rate`), and the credentials of another member named `caller_id`."""
    from peer.security import auth
    from peer.security.identity import Identity, certificate_bytes

    tracker = Identity.generate()
    daemon.gate.configure(run_id, tracker.public, "test-run-token-0123456789", rate)
    daemon.transport.messages = auth.RateLimit(rate)
    daemon.creds.certificate = tracker.sign(certificate_bytes(run_id, daemon.peer_id, daemon.identity.public))
    other = Identity.generate()
    other.peer_id = caller_id
    return auth.Credentials(
        identity=other, certificate=tracker.sign(certificate_bytes(run_id, caller_id, other.public))
    )
