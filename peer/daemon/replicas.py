"""A copy of another stage's training state on this peer, so a stage whose whole group dies
comes back from it and not from the initial weights.

Why: a stage's checkpoints sit on its own peers' disks, and when its whole group dies they are
gone with it. So two peers of each stage pull, now and then, the state (parameters, AdamW
moments, step) of the stage after their own (the last stage's: stage 0) from that stage's
most-trained peers, which the tracker names in their heartbeat replies (`Directive.replicate`;
bootstrap/tracker.py says who copies whom), and report the copy's stage and step. A peer that joins a stage with no live peer gets, in its Join reply, the holder of the
newest copy (`Assignment.restore_from`), downloads it (`GetShard`, what = STATE) and applies it
through the same checks as a download from the group (peer/daemon/state_sync.py), unless its
own checkpoint is newer.

Cost: a pull moves 12 bytes per parameter of the copied stage (fp32 weights and two moments);
one that took T s waits at least 9 T before the next, so copies use at most a tenth of the link.
The copy lives on disk with `--state-dir` (`replica/<run>/stage<k>.safetensors`), else in memory
(the memory plan, peer/daemon/memory.py, counts it on the host of a peer without a state dir).
A part of `PeerDaemon` (peer/daemon/main.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from peer.atomic import write_atomic
from peer.errors import AnchormeshError
from peer.pipeline.grpc_transport import GrpcTransport
from peer.store.shard import CHUNK_BYTES, ShardError, read_shard, shard_chunks, state_from_tensors
from peer.store.sketch import sketch_length
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.peer")
PULL_TIMEOUT_S = 1800.0  # one pull or restore download, whole (a big stage over a slow link)
LINK_SHARE = 0.1  # a pull that took T s waits at least T (1 / LINK_SHARE - 1) before the next
MAX_STATE_RATIO = (
    16  # a copy may be at most this many times this peer's own stage state (stages differ: embeddings, head)
)
DOWNLOAD_ERRORS = (ShardError, grpc.RpcError, OSError, AnchormeshError)  # what a state download may fail with


def failure(exc: BaseException) -> str:
    """A failed download in words: gRPC's details, else the exception's text."""
    return (exc.details() or exc.code().name) if isinstance(exc, grpc.RpcError) else str(exc)


class Replicas:
    """The replica this peer keeps (at most one stage's), its pulls, and the restore of a joiner."""

    def __init__(self, transport: GrpcTransport, peer_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.transport, self.peer_id, self.clock = transport, peer_id, clock
        self.run_id, self.every_s, self.dir = "", 0.0, None
        self.max_bytes = 1 << 30  # set from this peer's own stage at configure()
        self.stage, self.step = 0, 0  # the copy held: its stage and step (step 0 = none)
        self._tensors: dict[str, torch.Tensor] | None = None  # in memory when there is no state dir
        self._next_pull = 0.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.pulls = self.failures = 0

    def configure(self, run_id: str, every_s: float, state_dir: Path | None, own_state_bytes: int) -> None:
        """Called at the Join: the run, the pull cadence, where copies live, and the size bound
        (a peer that announces a bigger copy is refused before it is read)."""
        self.run_id, self.every_s = run_id, every_s
        self._next_pull = self.clock() + every_s  # the first copy after one pause: a young run has little to lose
        self.max_bytes = MAX_STATE_RATIO * own_state_bytes + (64 << 20)
        if state_dir is not None:
            self.dir = Path(state_dir) / "replica" / run_id
            self._load_from_disk()

    def _path(self, stage: int) -> Path:
        return self.dir / f"stage{stage}.safetensors"

    def _load_from_disk(self) -> None:
        """A restarted peer still holds the copy it pulled before (the newest, when several)."""
        for path in sorted(self.dir.glob("stage*.safetensors")) if self.dir.is_dir() else []:
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                stage, step = int(meta["stage"]), int(meta["step"])
            except Exception as exc:  # a damaged file is not a copy
                log.warning("replica %s ignored: %s", path, exc)
                continue
            if meta.get("run_id") == self.run_id and step > self.step:
                self.stage, self.step = stage, step
        if self.step:
            log.info("holding the replica of stage %d at step %d from disk", self.stage, self.step)

    # -- serving ---------------------------------------------------------------------------------
    def chunks(self, stage: int, num_stages: int):
        """The copy of `stage` as GetShard chunks; KeyError when this peer holds none."""
        with self._lock:
            if not self.step or self.stage != stage:
                raise KeyError(f"peer {self.peer_id} holds no replica of stage {stage}")
            tensors = self._tensors if self._tensors is not None else load_file(str(self._path(stage)))
            step = self.step
        return shard_chunks(
            tensors, run_id=self.run_id, peer_id=self.peer_id, stage=stage, num_stages=num_stages, step=step
        )

    # -- pulling ---------------------------------------------------------------------------------
    def due(self, target: pb.PeerInfo | None) -> bool:
        """Whether to pull from `target` now: pulls on, none running, its pause over, and the target
        newer than the copy held."""
        if not self.every_s or target is None or not target.address or target.step == 0:
            return False
        if self._thread is not None and self._thread.is_alive():
            return False
        return self.clock() >= self._next_pull and (target.stage != self.stage or target.step > self.step)

    def maybe_pull(self, target: pb.PeerInfo | None) -> None:
        """Called with each heartbeat reply's `replicate`: start a pull in the background when due."""
        if self.due(target):
            self._thread = threading.Thread(target=self.pull, args=(target,), name="replica-pull", daemon=True)
            self._thread.start()

    def pull(self, target: pb.PeerInfo) -> bool:
        """Copy `target`'s stage state; a failed pull is logged and tried again after the pause."""
        t0 = self.clock()
        try:
            shard = self.fetch(target)
            if shard.step <= 0:
                raise ShardError(f"step {shard.step}: nothing trained to copy")
            self._keep(shard.stage, shard.step, shard.tensors)
            self.pulls += 1
            log.info(
                "replica of stage %d at step %d from %s (%.1f MB in %.1f s)",
                shard.stage,
                shard.step,
                target.peer_id,
                sum(t.numel() * t.element_size() for t in shard.tensors.values()) / 1e6,
                self.clock() - t0,
            )
            return True
        except DOWNLOAD_ERRORS as exc:
            self.failures += 1
            log.warning(
                "replica of stage %d from %s failed (%d so far): %s",
                target.stage,
                target.peer_id,
                self.failures,
                failure(exc),
            )
            return False
        finally:
            took = self.clock() - t0
            self._next_pull = self.clock() + max(self.every_s, took * (1 / LINK_SHARE - 1))

    def fetch(self, holder: pb.PeerInfo, stage: int | None = None):
        """Download the state of `stage` (default: the holder's own) from `holder`, checked as a
        shard of this run and of that stage, at most `max_bytes`."""
        stage = holder.stage if stage is None else stage
        call = self.transport.channel(holder.address).unary_stream(
            "/anchormesh.v1.Stage/GetShard",
            request_serializer=pb.ShardRequest.SerializeToString,
            response_deserializer=pb.ShardChunk.FromString,
        )
        req = pb.ShardRequest(run_id=self.run_id, sender=self.peer_id, what=pb.ShardRequest.STATE, stage=stage)
        shard = read_shard(call(req, timeout=PULL_TIMEOUT_S), max_bytes=self.max_bytes)
        if shard.run_id != self.run_id or shard.stage != stage:
            raise ShardError(
                f"{holder.peer_id} sent stage {shard.stage} of run {shard.run_id!r}, not stage {stage} of {self.run_id!r}"
            )
        return shard

    def _keep(self, stage: int, step: int, tensors: dict[str, torch.Tensor]) -> None:
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_atomic(
                self._path(stage),
                save(tensors, metadata={"run_id": self.run_id, "stage": str(stage), "step": str(step)}),
            )
        with self._lock:
            old = self.stage if self.step else None
            self.stage, self.step = stage, step
            self._tensors = None if self.dir is not None else tensors
        if self.dir is not None and old is not None and old != stage:
            self._path(old).unlink(missing_ok=True)

    # -- a joiner's download: from a stage mate, or the replica of a stage whose group died -------------
    def download(
        self, holder: pb.PeerInfo, stage: int, names: list[str], apply: Callable[[object, list, str], bool], source: str
    ) -> bool:
        """Download the state of `stage` from `holder` (its own, or the replica it keeps) and apply
        it (`apply` is StateSync.apply_state: whole or not at all, only when newer than what this
        peer holds). False when the download failed or the state was refused."""
        log.info("downloading the state of stage %d from %s (step %d)", stage, source, holder.step)
        try:
            meta, tensors = state_from_tensors(self.fetch(holder, stage).tensors, names)
        except DOWNLOAD_ERRORS as exc:
            log.warning("the state of stage %d from %s could not be read: %s", stage, source, failure(exc))
            return False
        return apply(meta, tensors, source)

    def sketches(self, holder: pb.PeerInfo, stage: torch.nn.Module, seed: int, size: int) -> list[torch.Tensor]:
        """Count sketches of `holder`'s weights of this peer's `stage` (`GetShard`, what = SKETCH:
        `size` values a tensor, hashed with `seed`; peer/store/sketch.py) in named_parameters
        order, to compare a donor's state with (peer/daemon/state_witness.py)."""
        call = self.transport.channel(holder.address).unary_stream(
            "/anchormesh.v1.Stage/GetShard",
            request_serializer=pb.ShardRequest.SerializeToString,
            response_deserializer=pb.ShardChunk.FromString,
        )
        request = pb.ShardRequest(
            run_id=self.run_id, sender=self.peer_id, what=pb.ShardRequest.SKETCH, sketch_seed=seed, sketch_size=size
        )
        shard = read_shard(call(request, timeout=PULL_TIMEOUT_S), max_bytes=self.max_bytes)
        params = list(stage.named_parameters())
        names = [stage.hf_names[name] for name, _ in params]
        if shard.run_id != self.run_id or shard.stage != stage.index or sorted(shard.tensors) != sorted(names):
            raise ShardError(
                f"{holder.peer_id} sent the weights of stage {shard.stage} of run {shard.run_id!r}, not this stage's"
            )
        for n, (_, p) in zip(names, params):
            t = shard.tensors[n]
            if tuple(t.shape) != (sketch_length(p.numel(), size),) or t.dtype != torch.float32:
                raise ShardError(
                    f"{holder.peer_id} sent a sketch of {n} of shape {tuple(t.shape)} {t.dtype}, "
                    f"not ({sketch_length(p.numel(), size)},) float32"
                )
        return [shard.tensors[n] for n in names]

    def fetchers(
        self, stage: torch.nn.Module, apply: Callable[[object, list, str], bool], source: str = ""
    ) -> tuple[Callable[[pb.PeerInfo], bool], Callable[[pb.PeerInfo, int, int], list[torch.Tensor]]]:
        """For StateSync: download and apply a holder's state of `stage` (`source` names it in the
        log; default: a group member), and fetch a holder's sketches of its weights."""
        names = [name for name, _ in stage.named_parameters()]
        return (lambda h: self.download(h, stage.index, names, apply, source or f"a group member ({h.peer_id})")), (
            lambda h, seed, size: self.sketches(h, stage, seed, size)
        )


def own_state_bytes(stage: torch.nn.Module) -> int:
    """What this peer's own stage state takes on the wire: fp32 weights and two moments."""
    return 3 * 4 * sum(p.numel() for p in stage.parameters()) + CHUNK_BYTES
