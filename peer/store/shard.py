"""A stage's weights on the wire (`Stage.GetShard`): one safetensors file cut into `ShardChunk`s.

Why safetensors: it is the format the export writes anyway, it carries names, dtypes and shapes
in its header, and loading it never runs code. Tensors are keyed by the full model's parameter
names (`StageModule.hf_names`), so a reader merges shards without knowing how the model was cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from peer.errors import AnchormeshError
from peer.wire import anchormesh_pb2 as pb

CHUNK_BYTES = 1 << 20
MAX_SHARD_BYTES = 64 << 30  # a reader refuses a claimed size beyond this


class ShardError(AnchormeshError):
    """A shard stream that is malformed or does not belong to the run/stage asked for."""


@dataclass
class Shard:
    """One stage's weights as a peer sent them."""

    run_id: str
    peer_id: str
    stage: int
    num_stages: int
    step: int
    tensors: dict[str, torch.Tensor]  # full-model parameter name -> tensor


def snapshot(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the stage's parameters under the full model's names. Call it under the lock that
    the optimizer step holds, so the copy is never half-updated."""
    return {stage.hf_names[name]: p.detach().to("cpu", copy=True).contiguous() for name, p in stage.named_parameters()}


def shard_chunks(
    tensors: dict[str, torch.Tensor],
    *,
    run_id: str,
    peer_id: str,
    stage: int,
    num_stages: int,
    step: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[pb.ShardChunk]:
    """The snapshot as a safetensors file in chunks of at most `chunk_bytes` (serialized once, up front)."""
    blob = st_save(tensors, metadata={"run_id": run_id, "stage": str(stage), "step": str(step)})
    head = dict(run_id=run_id, peer_id=peer_id, stage=stage, num_stages=num_stages, step=step, total_bytes=len(blob))

    def chunks() -> Iterator[pb.ShardChunk]:
        for offset in range(0, max(len(blob), 1), chunk_bytes):
            yield pb.ShardChunk(
                **head,
                offset=offset,
                data=blob[offset : offset + chunk_bytes],
                names=sorted(tensors) if offset == 0 else [],
            )

    return chunks()


def read_shard(
    chunks: Iterable[pb.ShardChunk],
    progress: Callable[[int, int], None] | None = None,
    max_bytes: int = MAX_SHARD_BYTES,
) -> Shard:
    """Reassemble and check a GetShard stream: contiguous offsets, the same header on every chunk,
    the announced size (at most `max_bytes`), and the names of the first chunk equal to the
    file's. `progress(n, total)` is called with each chunk's byte count. Raises ShardError."""
    parts: list[bytes] = []
    first: pb.ShardChunk | None = None
    got = 0
    for c in chunks:
        if first is None:
            first = c
            if c.total_bytes > max_bytes:
                raise ShardError(f"shard of {c.total_bytes} bytes: more than the {max_bytes} it may have")
        key = (c.run_id, c.peer_id, c.stage, c.num_stages, c.step, c.total_bytes)
        if key != (first.run_id, first.peer_id, first.stage, first.num_stages, first.step, first.total_bytes):
            raise ShardError(f"chunk at offset {c.offset}: its header differs from the first chunk's")
        if c.offset != got:
            raise ShardError(f"chunk at offset {c.offset}: expected offset {got}")
        got += len(c.data)
        if got > first.total_bytes:
            raise ShardError(f"{got} bytes received: more than the announced {first.total_bytes}")
        parts.append(c.data)
        if progress is not None:
            progress(len(c.data), first.total_bytes)
    if first is None:
        raise ShardError("the peer sent no chunk")
    if got != first.total_bytes:
        raise ShardError(f"{got} bytes received of the announced {first.total_bytes}")
    try:
        tensors = st_load(b"".join(parts))
    except Exception as exc:  # safetensors raises its own error types
        raise ShardError(f"not a safetensors file: {exc}") from exc
    if sorted(tensors) != list(first.names):
        raise ShardError(f"the file holds {len(tensors)} tensors, the header names {len(first.names)} others")
    return Shard(first.run_id, first.peer_id, first.stage, first.num_stages, first.step, tensors)


# -- a stage's training state (parameters and AdamW moments) as a shard -----------------------------
STATE_PARTS = ("param", "exp_avg", "exp_avg_sq")  # the order StateSync.stage_state lists them in


def state_tensors(metadata: dict, names: list[str], tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """`StateSync.stage_state`'s (metadata, tensors) as one dict a shard can carry: "param.NAME",
    "exp_avg.NAME", "exp_avg_sq.NAME" under the stage module's own parameter names, and the step
    counts as 0-dim tensors (a safetensors file holds tensors and strings only)."""
    n = len(names)
    out = {
        f"{part}.{name}": t.contiguous()
        for i, part in enumerate(STATE_PARTS)
        for name, t in zip(names, tensors[i * n : (i + 1) * n])
    }
    out["meta.version"] = torch.tensor(int(metadata["version"]), dtype=torch.int64)
    out["meta.adam_step"] = torch.tensor(float(metadata["adam_step"]), dtype=torch.float64)
    return out


def state_from_tensors(tensors: dict[str, torch.Tensor], names: list[str]) -> tuple[dict, list[torch.Tensor]]:
    """The inverse of `state_tensors` for a stage with parameters `names`: raises ShardError when a
    tensor is missing or one more is there (shapes and values are StateSync.apply_state's to check)."""
    want = [f"{part}.{name}" for part in STATE_PARTS for name in names]
    extra = set(tensors) - set(want) - {"meta.version", "meta.adam_step"}
    missing = [k for k in [*want, "meta.version", "meta.adam_step"] if k not in tensors]
    if missing or extra:
        raise ShardError(
            f"not this stage's state: {len(missing)} tensors missing (e.g. {missing[:1]}), {len(extra)} unknown (e.g. {sorted(extra)[:1]})"
        )
    version, adam_step = tensors["meta.version"], tensors["meta.adam_step"]
    if version.numel() != 1 or adam_step.numel() != 1:
        raise ShardError("malformed step counts")
    return {"version": int(version), "adam_step": float(adam_step)}, [tensors[k] for k in want]
