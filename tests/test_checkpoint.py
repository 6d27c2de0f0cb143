"""Shard checkpoints (peer/store/checkpoint.py) and a peer resuming from them (PeerDaemon).

Checks: a checkpoint round-trips exactly; only the newest `keep` stay; a damaged, truncated,
foreign or half-written checkpoint is skipped with a message and the next older one used; a
daemon resumes weights, AdamW moments and step from its newest valid checkpoint, and ignores
one whose tensors do not fit its stage (weights untouched).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from peer.config import MaskConfig, ModelConfig, PipelineConfig, TrainConfig
from peer.daemon.main import PeerDaemon
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.pipeline.worker import StageWorker
from peer.store.checkpoint import ShardCheckpoints

CFG = TrainConfig(
    model=ModelConfig(name="tiny-llama", num_stages=2, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=16),
    mask=MaskConfig(scheme="mask"),
    pipeline=PipelineConfig(micro_batch_size=2, seq_len=8, max_staleness=0),
)


def state(step: int, fill: float = 1.0) -> tuple[dict, list[str], list[torch.Tensor]]:
    tensors = [torch.full((3, 4), fill), torch.arange(5, dtype=torch.float32) * fill]
    return {"version": step, "adam_step": float(step)}, ["a", "b"], tensors


def test_a_checkpoint_round_trips_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    ck = ShardCheckpoints(tmp_path, "run-x", 1, keep=2)
    for step in (5, 10, 15):
        ck.save(*state(step, fill=step))
    assert ck.steps() == [15, 10]
    assert sorted(p.name for p in ck.dir.iterdir()) == [
        "step00000010.json",
        "step00000010.pt",
        "step00000015.json",
        "step00000015.pt",
    ]
    got = ck.newest()
    meta, names, tensors = got.metadata, got.names, got.tensors
    assert meta == {"version": 15, "adam_step": 15.0} and names == ["a", "b"] and got.step == 15
    assert all(torch.equal(a, b) for a, b in zip(tensors, state(15, fill=15)[2]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-manifest", "bad-manifest", "other-run"])
def test_a_damaged_checkpoint_is_skipped_for_the_older_one(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    ck = ShardCheckpoints(tmp_path, "run-x", 0, keep=3)
    ck.save(*state(5, fill=5))
    newest = ck.save(*state(10, fill=10))
    manifest = newest.with_suffix(".json")
    if damage == "flip":
        raw = bytearray(newest.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        newest.write_bytes(bytes(raw))
    elif damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:100])
    elif damage == "no-manifest":  # killed between the data file and its manifest
        manifest.unlink()
    elif damage == "bad-manifest":
        manifest.write_text("{not json")
    else:  # a checkpoint of another run copied in, manifest and all
        other = ShardCheckpoints(tmp_path / "elsewhere", "run-y", 0)
        src = other.save(*state(10, fill=99))
        newest.write_bytes(src.read_bytes())
        manifest.write_bytes(src.with_suffix(".json").read_bytes())
    with caplog.at_level(logging.WARNING, logger="peer.store.checkpoint"):
        got = ck.newest()
    meta, tensors = got.metadata, got.tensors
    assert meta["version"] == 5 and torch.equal(tensors[0], torch.full((3, 4), 5.0))
    if damage != "no-manifest":
        assert "skipping checkpoint step 10" in caplog.text


def test_a_half_written_temp_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    ck = ShardCheckpoints(tmp_path, "run-x", 0)
    ck.dir.mkdir(parents=True)
    (ck.dir / ".step00000020.pt.tmp").write_bytes(b"partial")
    assert ck.steps() == [] and ck.newest() is None


# -- a daemon resuming ----------------------------------------------------------------------------
def make_daemon(state_dir: Path) -> PeerDaemon:
    d = PeerDaemon("127.0.0.1:9", state_dir=state_dir)
    stage = split_model(load_causal_lm(CFG.model, seed=0), 2)[1]
    d.worker = StageWorker(stage, 0, CFG, d.transport, "run", peer_id=d.peer_id, local_steps=True)
    d.checkpoints = ShardCheckpoints(state_dir, "run", 1, keep=2)
    return d


def trained(d: PeerDaemon, step: int) -> None:
    """Pretend `step` optimizer steps happened: weights moved, AdamW moments set."""
    with torch.no_grad():
        for p in d.worker.stage.parameters():
            p.add_(0.01 * step)
            d.worker.optimizer.opt.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": torch.full_like(p, 0.1),
                "exp_avg_sq": torch.full_like(p, 0.2),
            }
    d.worker.version, d.steps_done = step, step


def test_a_restarted_peer_resumes_its_newest_checkpoint(tmp_path: Path) -> None:
    old = make_daemon(tmp_path)
    try:
        trained(old, 7)
        old.checkpointer.write(wait=True)
        expected = [p.detach().clone() for p in old.worker.stage.parameters()]
    finally:
        old.transport.close()
    new = make_daemon(tmp_path)
    try:
        new.checkpointer.resume()
        assert new.worker.version == 7 and new.state_step == 7
        assert all(torch.equal(a, b) for a, b in zip(expected, new.worker.stage.parameters()))
        p0 = next(new.worker.stage.parameters())
        st = new.worker.optimizer.opt.state[p0]
        assert float(st["step"]) == 7.0 and torch.all(st["exp_avg"] == 0.1)
        # a group state no newer than the checkpoint is not taken over it
        meta, tensors = new.state_sync.stage_state()
        assert not new.state_sync.apply_state(
            {"version": 7, "adam_step": 7.0}, [t + 1 for t in tensors], source="a group member"
        )
        assert all(torch.equal(a, b) for a, b in zip(expected, new.worker.stage.parameters()))
    finally:
        new.transport.close()


def test_a_checkpoint_that_does_not_fit_leaves_the_weights_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = make_daemon(tmp_path)
    try:
        meta, tensors = d.state_sync.stage_state()
        names = [n for n, _ in d.worker.stage.named_parameters()] * 3
        tensors[1] = torch.full_like(tensors[1], float("nan"))
        d.checkpoints.save({"version": 9, "adam_step": 9.0}, names, tensors)
        before = [p.detach().clone() for p in d.worker.stage.parameters()]
        with caplog.at_level(logging.WARNING):
            d.checkpointer.resume()
        assert "is not finite" in caplog.text
        assert d.worker.version == 0 and d.state_step == -1
        assert all(torch.equal(a, b) for a, b in zip(before, d.worker.stage.parameters()))
    finally:
        d.transport.close()


def test_untrained_initial_weights_are_not_checkpointed(tmp_path: Path) -> None:
    d = make_daemon(tmp_path)
    try:
        d.worker.version = 40  # a joiner continues the run's numbering but holds the initial weights
        d.checkpointer.write(wait=True)
        assert d.checkpoints.steps() == []
    finally:
        d.transport.close()
