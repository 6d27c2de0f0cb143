"""Shard checkpoints on a peer's disk: atomic, checksummed, newest-valid-wins.

A peer with `--state-dir DIR` keeps its stage's state (parameters, AdamW moments, step) in
`DIR/checkpoints/<run_id>/stage<k>/step<NNNNNNNN>.pt`, each with a manifest beside it
(`.json`: sha256, size, step). Why two files: the manifest is written last, so a checkpoint
counts only once its data is whole on disk; a kill mid-write leaves a temp file or a data file
without a manifest, both ignored. Both are written to a temp name, fsynced and renamed. On
restart the newest checkpoint whose checksum matches is used; a corrupt one is skipped with a
message and the next older one tried.

The tensors are the same list the stage group hands a joiner (`StateSync.stage_state`, peer/daemon/state_sync.py), so
one validation path (`StateSync.apply_state`) checks both before they touch the model.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from tqdm import tqdm

from peer.atomic import fsync_dir, write_atomic
from peer.progress import byte_bar

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^step(\d{8,})\.json$")
_CHUNK = 1 << 20


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through (and moves a progress bar)."""

    def __init__(self, f: BinaryIO, bar: tqdm) -> None:
        self.f, self.bar, self.sha, self.size = f, bar, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        n = self.f.write(b)
        self.sha.update(memoryview(b)[:n])
        self.size += n
        self.bar.update(n)
        return n


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message says why. Nothing of it is left on disk."""


def failure_reason(exc: BaseException, where: Path, need: int = 0) -> str:
    """Why a write failed, in words: the OS error behind it when the exception chain holds one,
    else the exception, plus the free space when it is below what the write needed (torch.save
    turns ENOSPC into a bare RuntimeError)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return f"{os.strerror(e.errno)} ({where})"
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    first = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {first[-1] if first else 'no message'}"
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        return text
    if free < need:
        return f"no space left on device? {free / 1e6:.1f} MB free in {where}, {need / 1e6:.1f} MB needed ({text})"
    return text


@dataclass
class Checkpoint:
    """One checked checkpoint: the stage state as `StateSync.stage_state` gives it (parameters,
    then AdamW exp_avg, then exp_avg_sq, all in `names` order) and the parameters' full-model names."""

    path: Path
    metadata: dict
    names: list[str]
    tensors: list[torch.Tensor]
    hf_names: list[str] | None

    @property
    def step(self) -> int:
        return int(self.metadata["version"])


def run_dirs(root: Path) -> dict[str, Path]:
    """run id -> its folder, under a peer's state dir (or its `checkpoints/` folder)."""
    base = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    return {d.name: d for d in sorted(base.iterdir()) if d.is_dir() and any(d.glob("stage*"))} if base.is_dir() else {}


class ShardCheckpoints:
    """The checkpoints of one stage of one run on this peer's disk.

    `run_info` (the run's config and code version), when given, is written once beside the stage
    folders as `run.json`: with it the checkpoints alone make a model (`anchormesh export
    --checkpoints`), even after the run and its tracker are gone."""

    def __init__(self, state_dir: Path, run_id: str, stage: int, keep: int = 2, run_info: dict | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1")
        self.dir = Path(state_dir) / "checkpoints" / run_id / f"stage{stage}"
        self.run_id, self.stage, self.keep, self.run_info = run_id, stage, keep, run_info

    def steps(self) -> list[int]:
        """Steps that have a manifest, newest first (not yet checked)."""
        if not self.dir.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.dir.iterdir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def _paths(self, step: int) -> tuple[Path, Path]:
        return self.dir / f"step{step:08d}.pt", self.dir / f"step{step:08d}.json"

    def save(
        self, metadata: dict, names: list[str], tensors: list[torch.Tensor], hf_names: list[str] | None = None
    ) -> Path:
        """Write one checkpoint (atomically), then drop all but the newest `keep`. Any failure
        (a full disk makes torch.save raise RuntimeError, not OSError) raises CheckpointWriteError
        with the reason, after removing what it wrote: the older checkpoints stay the valid ones."""
        step = int(metadata["version"])
        total = sum(t.numel() * t.element_size() for t in tensors)
        data, manifest = self._paths(step)
        existed = manifest.exists()  # a checkpoint of this step written before is not this write's to remove
        try:
            return self._save(step, metadata, names, tensors, hf_names, total)
        except Exception as exc:
            for p in () if existed else (manifest, data):  # the manifest first: a data file without one never counts
                try:
                    p.unlink(missing_ok=True)
                except OSError:
                    pass
            raise CheckpointWriteError(
                f"checkpoint of stage {self.stage} at step {step}: {failure_reason(exc, self.dir, total)}"
            ) from exc

    def _sweep_temp_files(self) -> None:
        """Temp files a killed writer left: never a checkpoint, but they hold disk space."""
        for p in self.dir.glob(".step*.tmp"):
            try:
                p.unlink()
            except OSError:
                pass

    def _save(
        self,
        step: int,
        metadata: dict,
        names: list[str],
        tensors: list[torch.Tensor],
        hf_names: list[str] | None,
        total: int,
    ) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sweep_temp_files()
        info_path = self.dir.parent / "run.json"
        if self.run_info is not None and not info_path.exists():
            write_atomic(info_path, json.dumps(self.run_info, indent=2).encode())
        data, manifest = self._paths(step)
        t0 = time.monotonic()
        payload = {
            "format": FORMAT,
            "run_id": self.run_id,
            "stage": self.stage,
            "metadata": metadata,
            "names": names,
            "tensors": tensors,
            "hf_names": hf_names,
        }
        writer: _HashingWriter | None = None

        def write(f: BinaryIO) -> None:
            nonlocal writer
            with byte_bar(f"checkpoint step {step}", total) as bar:
                writer = _HashingWriter(f, bar)
                torch.save(payload, writer)

        write_atomic(data, write)
        assert writer is not None
        info = {
            "format": FORMAT,
            "file": data.name,
            "sha256": writer.sha.hexdigest(),
            "bytes": writer.size,
            "step": step,
            "run_id": self.run_id,
            "stage": self.stage,
            "written_at": time.time(),
        }
        write_atomic(manifest, json.dumps(info).encode())
        fsync_dir(self.dir)
        dt = time.monotonic() - t0
        log.info(
            "checkpoint of stage %d at step %d: %.1f MB in %.1fs (%.1f MB/s) -> %s",
            self.stage,
            step,
            writer.size / 1e6,
            dt,
            writer.size / 1e6 / max(dt, 1e-6),
            data,
        )
        for old in self.steps()[self.keep :]:
            for p in self._paths(old):
                p.unlink(missing_ok=True)
        return data

    def load(self, step: int) -> Checkpoint:
        """One checkpoint, after its checksum and header are checked; raises ValueError naming what is wrong."""
        data, manifest = self._paths(step)
        try:
            info = json.loads(manifest.read_text())
            want, size = str(info["sha256"]), int(info["bytes"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{manifest}: unreadable manifest ({exc})") from None
        sha = hashlib.sha256()
        try:
            with open(data, "rb") as f, byte_bar(f"checking checkpoint step {step}", size) as bar:
                while chunk := f.read(_CHUNK):
                    sha.update(chunk)
                    bar.update(len(chunk))
        except OSError as exc:
            raise ValueError(f"{data}: cannot read ({exc.strerror})") from None
        if sha.hexdigest() != want:
            raise ValueError(f"{data}: checksum mismatch (the file is damaged or was changed)")
        try:
            payload = torch.load(data, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # a file that hashes right but does not unpickle: written by something else
            raise ValueError(f"{data}: cannot load ({type(exc).__name__}: {exc})") from None
        if (
            not isinstance(payload, dict)
            or payload.get("format") != FORMAT
            or payload.get("run_id") != self.run_id
            or payload.get("stage") != self.stage
        ):
            raise ValueError(f"{data}: not a format-{FORMAT} checkpoint of stage {self.stage} of run {self.run_id}")
        meta, names, tensors, hf_names = (
            payload.get("metadata"),
            payload.get("names"),
            payload.get("tensors"),
            payload.get("hf_names"),
        )
        if (
            not isinstance(meta, dict)
            or not isinstance(names, list)
            or not isinstance(tensors, list)
            or not all(isinstance(t, torch.Tensor) for t in tensors)
        ):
            raise ValueError(f"{data}: malformed checkpoint contents")
        if hf_names is not None and (not isinstance(hf_names, list) or not all(isinstance(n, str) for n in hf_names)):
            raise ValueError(f"{data}: malformed checkpoint contents (hf_names)")
        try:
            int(meta["version"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{data}: malformed checkpoint metadata") from None
        return Checkpoint(data, meta, names, tensors, hf_names)

    def newest(self) -> Checkpoint | None:
        """The newest checkpoint that checks out; damaged ones are skipped with a warning."""
        for step in self.steps():
            try:
                return self.load(step)
            except ValueError as exc:
                log.warning("skipping checkpoint step %d: %s", step, exc)
        return None
