"""A peer's shard checkpoints under `--state-dir`: resume from the newest at start, write one
every `checkpoint.every` steps and at exit.

The copy is taken between steps and written by a background thread, so the fast circuit never
waits on the disk; a failed write (full disk, I/O error) is counted and logged and training goes
on, and the store (peer/store/checkpoint.py) removes its `.tmp` files. What is resumed is checked
exactly like a download from the group (peer/daemon/state_sync.py). A part of `PeerDaemon`
(peer/daemon/main.py); it reads the daemon's store and step counts when asked through the narrow
`CheckpointHolder` view (the store exists once the stage is known).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from peer.daemon.state_sync import StateSync
from peer.pipeline.worker import StageWorker
from peer.store.checkpoint import ShardCheckpoints

log = logging.getLogger("anchormesh.peer")


class CheckpointHolder(Protocol):
    """What checkpointing reads and writes of the peer."""

    worker: StageWorker | None
    checkpoints: ShardCheckpoints | None  # with --state-dir, once the stage is known
    steps_done: int  # optimizer steps this peer has taken itself
    state_step: int  # the step of the state taken from a checkpoint or the group; -1 = initial weights
    resumed_from: str


class Checkpointer:
    """Resumes from and writes this stage's checkpoints; counts the writes that failed."""

    def __init__(self, peer: CheckpointHolder, sync: StateSync) -> None:
        self.peer, self.sync = peer, sync
        self.written = 0  # the step of the newest checkpoint written
        self.failures = 0  # checkpoint writes that failed (full disk, I/O error): logged, training goes on
        self._thread: threading.Thread | None = None

    def resume(self) -> None:
        """A restarted peer takes its newest valid checkpoint of this stage (checked like a download)."""
        checkpoints = self.peer.checkpoints
        if checkpoints is None:
            return
        got = checkpoints.newest()
        if got is None:
            return
        expected = [name for name, _ in self.peer.worker.stage.named_parameters()]
        if got.names != expected * 3:
            log.warning("checkpoint in %s ignored: its tensors are not this stage's parameters", checkpoints.dir)
            return
        if self.sync.apply_state(got.metadata, got.tensors, source=f"checkpoint {checkpoints.dir}"):
            self.peer.resumed_from = f"checkpoint step {got.step}"
            self.written = got.step  # already on disk: not written again at this step

    def write(self, wait: bool = False) -> None:
        """Write a checkpoint of the state as it is now; the copy is taken between steps, the
        write runs in a background thread so the fast circuit never waits on the disk. A
        checkpoint still being written makes a new one wait (`wait`, at exit) or be skipped."""
        peer = self.peer
        if peer.checkpoints is None or peer.worker is None or peer.worker.version == self.written:
            return
        if peer.steps_done == 0 and peer.state_step < 0:  # initial weights: nothing worth keeping
            return
        busy = self._thread is not None and self._thread.is_alive()
        if busy and not wait:
            log.warning("checkpoint at step %d skipped: the previous one is still being written", peer.worker.version)
            return
        if busy:
            self._thread.join()
        meta, tensors = self.sync.stage_state()
        stage = peer.worker.stage
        names = [name for name, _ in stage.named_parameters()] * 3
        hf_names = [stage.hf_names[name] for name, _ in stage.named_parameters()]
        step, before = int(meta["version"]), self.written
        self.written = step

        def write() -> None:
            try:
                peer.checkpoints.save(meta, names, tensors, hf_names)
            except Exception as exc:  # a full disk or any other failure: counted and logged, never the end of the peer
                self.failures += 1
                if self.written == step:  # not written: the step may be tried again (at exit, say)
                    self.written = before
                log.error("checkpoint at step %d failed (%d so far), training goes on: %s", step, self.failures, exc)

        self._thread = threading.Thread(target=write, name="checkpoint", daemon=True)
        self._thread.start()
        if wait:
            self._thread.join()
