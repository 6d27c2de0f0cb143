"""Faults a peer must live through: a full disk under its checkpoints and metrics.jsonl, a SIGKILL
that must not leave its children running, a resume whose group is gone.

Checks: a checkpoint write that fails (OSError(ENOSPC), torch.save's RuntimeError mid-write, a
real tmpfs that fills up) is logged with its reason and counted, leaves no temp file and no
checkpoint that counts, the peer goes on, and a later checkpoint succeeds; a failed metrics.jsonl
write is counted, logged at most once a minute, and the file is opened again on the next write;
a SIGKILLed peer (and bootstrap) takes its p2pd and hivemind children with it; a peer whose run
is ahead and whose group does not answer says where it resumed from.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_checkpoint import make_daemon, trained

import peer.store.checkpoint as checkpoint_mod
from peer.atomic import write_atomic
from peer.daemon.runlog import MetricsLog


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


@pytest.fixture
def thread_errors() -> Iterator[list[BaseException]]:
    """Exceptions that escaped any thread (the checkpoint writer must let none out); its own
    patch, so a test's `monkeypatch.undo()` keeps it."""
    seen: list[BaseException] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
        yield seen


# -- checkpoint writes that fail -----------------------------------------------------------------
def test_write_atomic_removes_its_temp_file_when_the_writer_fails(tmp_path: Path) -> None:
    def half(f) -> None:
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(tmp_path / "f.bin", half)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("fault", ["enospc", "torch-runtime-error", "manifest-enospc"])
def test_a_failed_checkpoint_is_logged_counted_cleaned_and_the_next_one_succeeds(
    tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, thread_errors: list
) -> None:
    d = make_daemon(tmp_path)
    try:
        trained(d, 4)
        d.checkpointer.write(wait=True)
        good = leftovers(d.checkpoints.dir)
        trained(d, 8)
        if fault == "manifest-enospc":  # the data file is whole, its manifest cannot be written
            real = checkpoint_mod.write_atomic

            def no_manifest(path: Path, content, mode: int = 0o644) -> None:
                if path.suffix == ".json":
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
                real(path, content, mode)

            monkeypatch.setattr(checkpoint_mod, "write_atomic", no_manifest)
        else:
            real_write, err = checkpoint_mod._HashingWriter.write, fault

            def failing(self, b) -> int:
                if self.size > 2000:  # mid-write: some bytes are on disk already
                    raise (
                        OSError(errno.ENOSPC, "No space left on device")
                        if err == "enospc"
                        else RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed")
                    )
                return real_write(self, b)

            monkeypatch.setattr(checkpoint_mod._HashingWriter, "write", failing)
        with caplog.at_level(logging.ERROR, logger="peer.daemon.main"):
            d.checkpointer.write(wait=True)
        assert thread_errors == []
        assert d.checkpointer.failures == 1 and d.checkpointer.written == 4  # step 8 may be tried again
        assert leftovers(d.checkpoints.dir) == good and d.checkpoints.steps() == [4]
        assert "checkpoint at step 8 failed (1 so far), training goes on" in caplog.text
        assert (
            "RuntimeError: " if fault == "torch-runtime-error" else "No space left on device"
        ) in caplog.text  # torch re-raises its own
        monkeypatch.undo()  # the disk has room again
        d.checkpointer.write(wait=True)  # the same step, tried again (as at exit)
        assert d.checkpoints.steps() == [8, 4] and d.checkpointer.written == 8 and d.checkpointer.failures == 1
        assert d.checkpoints.newest().step == 8 and thread_errors == []
    finally:
        d.transport.close()


def test_failure_reason_names_a_full_disk_behind_a_bare_runtime_error(tmp_path: Path) -> None:
    reason = checkpoint_mod.failure_reason(
        RuntimeError(
            "[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/0: file write failed"
        ),
        tmp_path,
        need=1 << 62,
    )
    assert reason.startswith("no space left on device?") and "file write failed" in reason
    chained = RuntimeError("wrapped")
    chained.__context__ = OSError(errno.EIO, "Input/output error")
    assert checkpoint_mod.failure_reason(chained, tmp_path) == f"Input/output error ({tmp_path})"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root and a kernel that allows the mount), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("a real full disk needs root on Linux (mount -t tmpfs); the fault-injected tests cover the rest")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Fill `disk` to the last byte; returns the filler to delete."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_a_real_full_disk_fails_a_checkpoint_and_metrics_cleanly_then_both_resume(
    tiny_disk: Path, caplog: pytest.LogCaptureFixture, thread_errors: list
) -> None:
    d = make_daemon(tiny_disk)
    metrics = MetricsLog(tiny_disk / "metrics.jsonl")
    try:
        trained(d, 4)
        d.checkpointer.write(wait=True)
        assert d.checkpoints.steps() == [4] and metrics.write({"step": 4})
        filler = fill(tiny_disk)
        trained(d, 8)
        with caplog.at_level(logging.WARNING):
            d.checkpointer.write(wait=True)
            for step in range(5, 9):
                assert not metrics.write({"step": step, "pad": "x" * 5000})  # more than the page it has
        assert thread_errors == [] and d.checkpointer.failures == 1 and metrics.failures == 4
        assert "checkpoint at step 8 failed" in caplog.text
        assert "No space left on device" in caplog.text or "no space left on device?" in caplog.text
        assert caplog.text.count("cannot write") == 1  # rate-limited
        assert not [n for n in leftovers(d.checkpoints.dir) if n.endswith(".tmp")] and d.checkpoints.steps() == [4]
        filler.unlink()  # room again: the next checkpoint and the next metrics line land
        trained(d, 9)
        d.checkpointer.write(wait=True)
        assert d.checkpoints.steps() == [9, 4] and d.checkpoints.newest().step == 9
        assert metrics.write({"step": 9})
        assert [json.loads(line)["step"] for line in (tiny_disk / "metrics.jsonl").read_text().splitlines()] == [
            4,
            9,
        ]  # no cut line
    finally:
        metrics.close()
        d.transport.close()


# -- metrics.jsonl --------------------------------------------------------------------------------
def test_a_failed_metrics_write_is_counted_logged_once_a_minute_and_the_file_reopened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state" / "metrics.jsonl"
    m = MetricsLog(path)
    assert m.write({"step": 1})
    real_open = open
    broken = {"on": True}

    class FullFile:
        def __init__(self, f) -> None:
            self.f = f

        def write(self, b: bytes) -> int:
            self.f.write(b[: len(b) // 2])  # half a line reaches the disk, then it is full
            raise OSError(errno.ENOSPC, "No space left on device")

        def tell(self) -> int:
            return self.f.tell()

        def truncate(self, size: int) -> int:
            return self.f.truncate(size)

        def close(self) -> None:
            self.f.close()

    def opener(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return FullFile(f) if broken["on"] and "a" in mode else f

    m.close()
    monkeypatch.setattr("builtins.open", opener)
    with caplog.at_level(logging.WARNING, logger="peer.daemon.runlog"):
        results = [m.write({"step": s}) for s in range(2, 6)]
    assert results == [False] * 4 and m.failures == 4
    assert caplog.text.count("cannot write") == 1 and "No space left on device" in caplog.text
    broken["on"] = False  # room again: the next write opens the file again
    assert m.write({"step": 6})
    m.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1}, {"step": 6}]  # no cut line


def test_a_line_cut_by_a_kill_is_ended_before_the_next_one(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    m = MetricsLog(path)
    assert m.write({"step": 3})
    m.close()
    assert json.loads(path.read_text().splitlines()[-1]) == {"step": 3}


def test_metrics_write_never_raises_when_its_folder_is_gone(tmp_path: Path) -> None:
    m = MetricsLog(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").mkdir()  # not a file: every open fails
    assert not m.write({"step": 1}) and not m.write({"step": 2}) and m.failures == 2
    (tmp_path / "metrics.jsonl").rmdir()
    assert m.write({"step": 3})
    m.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3}


# -- where a replacement resumed from --------------------------------------------------------------
@pytest.mark.parametrize("has_checkpoint", [True, False])
def test_a_replacement_whose_group_is_gone_says_where_it_resumed_from(
    tmp_path: Path, has_checkpoint: bool, caplog: pytest.LogCaptureFixture
) -> None:
    if has_checkpoint:
        old = make_daemon(tmp_path)
        try:
            trained(old, 7)
            old.checkpointer.write(wait=True)
        finally:
            old.transport.close()
    d = make_daemon(tmp_path)
    try:
        d.worker.version = 20  # the run is at step 20 (the Join's start_step)
        d.checkpointer.resume()
        with caplog.at_level(logging.WARNING, logger="peer.daemon.main"):
            d.state_sync.load_group_state([], lambda donor: True)  # the tracker lists no donor
        where = "checkpoint step 7" if has_checkpoint else "initial weights"
        assert (
            d.resumed_from == where and f"resumed from {where}" in d.reason and f"resumed from {where}" in caplog.text
        )
        assert ("13 steps of this stage's training are lost" in d.reason) == has_checkpoint
        assert d.worker.version == 20
    finally:
        d.transport.close()


# -- a SIGKILLed process takes its children with it -------------------------------------------------
def ppid_of(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) from /proc, or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> dict[int, str]:
    """pid -> command name of every live descendant of `root`."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (got := ppid_of(int(entry))) is not None and got[1] != "Z":
            parents[int(entry)] = got[0]
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                try:
                    found[child] = Path(f"/proc/{child}/comm").read_text().strip()
                except OSError:
                    continue
                frontier.append(child)
    return found


def alive(pid: int) -> bool:
    """Running, not gone and not a zombie (a zombie is dead; here its new parent may never reap it)."""
    got = ppid_of(pid)
    return got is not None and got[1] != "Z"


def kill_and_watch(proc: subprocess.Popen, kids: dict[int, str], timeout_s: float = 10.0) -> dict[int, str]:
    """SIGKILL `proc` alone (not its group); the children still alive after `timeout_s`."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in kids):
        time.sleep(0.2)
    return {p: name for p, name in kids.items() if alive(p)}


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux only")
def test_a_sigkilled_peer_and_bootstrap_leave_no_children_running(tmp_path: Path) -> None:
    from swarmkit import tiny_run_toml, wait_for_status

    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

    (tmp_path / "run.toml").write_text(tiny_run_toml())
    procs: list[subprocess.Popen] = []
    recorded: dict[int, str] = {}
    try:
        procs.append(
            start_process(
                ["bootstrap", "--config", str(tmp_path / "run.toml"), "--state-dir", str(tmp_path / "boot")],
                tmp_path / "boot.log",
            )
        )
        boot = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log")
        procs.append(
            start_process(
                ["peer", "--tracker", boot["tracker"], "--token", f"@{tmp_path}/boot/bootstrap.json"],
                tmp_path / "peer.log",
            )
        )
        wait_for_status(
            boot["tracker"], lambda s: any(p["state"] in ("active", "idle") for p in s["peers"]), tmp_path, procs
        )
        peer = procs[1]
        deadline = time.monotonic() + 30
        while True:  # the DHT node, the averager and p2pd
            kids = descendants(peer.pid)
            if "p2pd" in kids.values() and len(kids) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        recorded.update(kids)
        assert "p2pd" in kids.values() and len(kids) >= 3, kids
        left = kill_and_watch(peer, kids)
        assert left == {}, f"the peer's children outlived it: {left} (all: {kids})"
        boot_kids = descendants(procs[0].pid)
        recorded.update(boot_kids)
        assert "p2pd" in boot_kids.values(), boot_kids
        left = kill_and_watch(procs[0], boot_kids)
        assert left == {}, f"the bootstrap's children outlived it: {left} (all: {boot_kids})"
    finally:
        for pid in recorded:  # only the pids this test recorded, whatever is left of them
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        stop_processes(procs, grace_s=10)


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux only")
def test_a_child_forked_by_a_short_lived_thread_is_not_killed_when_that_thread_ends(tmp_path: Path) -> None:
    """PDEATHSIG fires when the forking *thread* exits: such a child is left untied, not killed."""
    script = """
import multiprocessing as mp, threading, time, sys
from peer.daemon import orphans
assert orphans.install() and orphans.install()
procs = []
t = threading.Thread(target=lambda: procs.append(mp.Process(target=time.sleep, args=(30,), daemon=True)) or procs[0].start())
t.start(); t.join()
main_child = mp.Process(target=time.sleep, args=(30,), daemon=True); main_child.start()
time.sleep(1.0)
print(procs[0].is_alive(), main_child.is_alive(), flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent
    )
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stderr[-2000:]
