"""A joiner takes its stage group's state (peer/daemon/state_sync.py `load_group_state`): a download that
fits is applied whole (weights, AdamW moments, step); one that does not fit is ignored whole."""

from __future__ import annotations

import threading

import pytest
import torch

from peer.codec.mask import MaskCodec
from peer.config import ModelConfig, PipelineConfig, TrainConfig
from peer.daemon.main import PeerDaemon
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.pipeline.worker import StageWorker

CFG = TrainConfig(model=ModelConfig(name="tiny-llama", num_stages=2, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=16), pipeline=PipelineConfig(micro_batch_size=2, seq_len=8))


class FakeAverager:
    def __init__(self, state) -> None:
        self.lock, self.state = threading.Lock(), state
        self.rebased = 0

    def load_state(self, timeout: float):
        return self.state

    def rebase(self) -> None:  # the downloaded weights become the base of the next DP delta
        self.rebased += 1


def donor_state(stage) -> tuple[dict, list[torch.Tensor]]:
    params = [p.detach() + 1.0 for _, p in stage.named_parameters()]
    moments = [torch.full_like(p, 0.5) for _, p in stage.named_parameters()] + [torch.full_like(p, 0.25) for _, p in stage.named_parameters()]
    return {"version": 42, "adam_step": 40.0}, params + moments


@pytest.fixture
def daemon():
    d = PeerDaemon("127.0.0.1:9")
    stage = split_model(load_causal_lm(CFG.model, seed=0), 2)[1]
    d.worker = StageWorker(stage, 0, CFG, MaskCodec(CFG.mask), d.transport, "run", peer_id=d.peer_id, local_steps=True)
    yield d
    d.transport.close()


def test_a_fitting_state_is_applied_whole(daemon: PeerDaemon) -> None:
    meta, tensors = donor_state(daemon.worker.stage)
    daemon.averager = FakeAverager((meta, tensors))
    daemon.state_sync.load_group_state()
    named = list(daemon.worker.stage.named_parameters())
    assert all(torch.equal(p, t) for (_, p), t in zip(named, tensors))
    assert daemon.worker.version == 42
    assert daemon.averager.rebased == 1
    st = daemon.worker.optimizer.opt.state[named[0][1]]
    assert float(st["step"]) == 40.0 and torch.all(st["exp_avg"] == 0.5) and torch.all(st["exp_avg_sq"] == 0.25)
    # the state this peer offers in turn is what it now holds
    meta2, offered = daemon.state_sync.stage_state()
    assert meta2 == {"version": 42, "adam_step": 40.0} and all(torch.equal(a, b) for a, b in zip(offered, tensors))


@pytest.mark.parametrize("damage", ["shape", "nan", "count", "metadata"])
def test_a_state_that_does_not_fit_is_ignored_whole(daemon: PeerDaemon, damage: str) -> None:
    meta, tensors = donor_state(daemon.worker.stage)
    if damage == "shape":
        tensors[3] = torch.zeros(7)
    elif damage == "nan":
        tensors[-1] = torch.full_like(tensors[-1], float("nan"))
    elif damage == "count":
        tensors = tensors[:-1]
    else:
        meta = {"version": "x"}
    before = [p.detach().clone() for p in daemon.worker.stage.parameters()]
    daemon.averager = FakeAverager((meta, tensors))
    daemon.state_sync.load_group_state()
    assert all(torch.equal(a, b) for a, b in zip(before, daemon.worker.stage.parameters()))
    assert daemon.worker.version == 0 and not daemon.worker.optimizer.opt.state


def test_no_donor_keeps_the_initial_weights(daemon: PeerDaemon) -> None:
    before = [p.detach().clone() for p in daemon.worker.stage.parameters()]
    daemon.averager = FakeAverager(None)
    daemon.state_sync.load_group_state()
    assert all(torch.equal(a, b) for a, b in zip(before, daemon.worker.stage.parameters()))


@pytest.mark.parametrize("poison", ["huge_weights", "negative_second_moment", "first_moment_over_bound", "step_past_the_run"])
def test_a_poisoned_state_is_refused_whole(daemon: PeerDaemon, poison: str) -> None:
    """What an outsider offered a joiner (reproduced): version 2^62, weights of 1e30, a negative
    second moment (NaN after one AdamW step), a first moment no gradient sequence gives."""
    import time

    meta, tensors = donor_state(daemon.worker.stage)
    n = len(tensors) // 3
    daemon.state_sync.run_clock = (time.monotonic(), 40)  # joined when the run was at step 40
    if poison == "huge_weights":
        tensors[0] = torch.full_like(tensors[0], 1e30)
    elif poison == "negative_second_moment":
        tensors[2 * n] = -tensors[2 * n]
    elif poison == "first_moment_over_bound":
        tensors[n] = torch.full_like(tensors[n], 5.0)  # sqrt(v) = 0.5
    else:
        meta = {**meta, "version": 2**62}
    before = [p.detach().clone() for p in daemon.worker.stage.parameters()]
    daemon.averager = FakeAverager((meta, tensors))
    daemon.state_sync.load_group_state()
    assert all(torch.equal(a, b) for a, b in zip(before, daemon.worker.stage.parameters()))
    assert daemon.worker.version == 0 and not daemon.worker.optimizer.opt.state
    # the same download unpoisoned is taken
    daemon.averager = FakeAverager(donor_state(daemon.worker.stage))
    daemon.state_sync.load_group_state()
    assert daemon.worker.version == 42
