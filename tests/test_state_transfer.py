"""A joiner takes its stage group's state (peer/daemon/state_sync.py `load_group_state`): a download that
fits is applied whole (weights, AdamW moments, step); one that does not fit is ignored whole and
the next donor is asked."""

from __future__ import annotations

import threading

import pytest
import torch

from peer.config import MaskConfig, ModelConfig, PipelineConfig, TrainConfig
from peer.daemon.main import PeerDaemon
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.pipeline.worker import StageWorker
from peer.store.sketch import sketches
from peer.wire import anchormesh_pb2 as pb

CFG = TrainConfig(
    model=ModelConfig(name="tiny-llama", num_stages=2, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=16),
    mask=MaskConfig(scheme="mask"),
    pipeline=PipelineConfig(micro_batch_size=2, seq_len=8, max_staleness=0),
)


class FakeAverager:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rebased = 0

    def rebase(self) -> None:  # the downloaded weights become the base of the next DP delta
        self.rebased += 1


def take(daemon: PeerDaemon, *states) -> list[str]:
    """`load_group_state` with one donor per state (most-trained first, as the tracker lists
    them), each "download" handing its state to `apply_state`; returns the donors asked."""
    asked: list[str] = []

    def download(donor: pb.PeerInfo) -> bool:
        asked.append(donor.peer_id)
        meta, tensors = states[int(donor.peer_id[1:])]
        return daemon.state_sync.apply_state(meta, tensors, f"a group member ({donor.peer_id})")

    daemon.averager = daemon.averager or FakeAverager()
    daemon.state_sync.load_group_state([pb.PeerInfo(peer_id=f"d{i}", step=50) for i in range(len(states))], download)
    return asked


def donor_state(stage) -> tuple[dict, list[torch.Tensor]]:
    params = [p.detach() + 0.005 for _, p in stage.named_parameters()]  # a few steps of training away
    moments = [torch.full_like(p, 0.5) for _, p in stage.named_parameters()] + [
        torch.full_like(p, 0.25) for _, p in stage.named_parameters()
    ]
    return {"version": 42, "adam_step": 40.0}, params + moments


@pytest.fixture
def daemon():
    d = PeerDaemon("127.0.0.1:9")
    stage = split_model(load_causal_lm(CFG.model, seed=0), 2)[1]
    d.worker = StageWorker(stage, 0, CFG, d.transport, "run", peer_id=d.peer_id, local_steps=True)
    yield d
    d.transport.close()


def test_a_fitting_state_is_applied_whole(daemon: PeerDaemon) -> None:
    meta, tensors = donor_state(daemon.worker.stage)
    assert take(daemon, (meta, tensors)) == ["d0"]
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
    take(daemon, (meta, tensors))
    assert all(torch.equal(a, b) for a, b in zip(before, daemon.worker.stage.parameters()))
    assert daemon.worker.version == 0 and not daemon.worker.optimizer.opt.state


def test_no_donor_keeps_the_initial_weights(daemon: PeerDaemon) -> None:
    before = [p.detach().clone() for p in daemon.worker.stage.parameters()]
    assert take(daemon) == []
    assert daemon.resumed_from == "initial weights" and "no stage-group member answered" in daemon.reason
    assert all(torch.equal(a, b) for a, b in zip(before, daemon.worker.stage.parameters()))


@pytest.mark.parametrize(
    "poison", ["huge_weights", "negative_second_moment", "first_moment_over_bound", "step_past_the_run"]
)
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
    assert take(daemon, (meta, tensors)) == ["d0"]
    assert all(torch.equal(a, b) for a, b in zip(before, daemon.worker.stage.parameters()))
    assert daemon.worker.version == 0 and not daemon.worker.optimizer.opt.state
    # a poisoned donor first, an honest one next: the next donor is asked and its state taken
    assert take(daemon, (meta, tensors), donor_state(daemon.worker.stage)) == ["d0", "d1"]
    assert daemon.worker.version == 42 and daemon.resumed_from == "group step 42"


def hostile(daemon: PeerDaemon, kind: str) -> tuple[dict, list[torch.Tensor]]:
    """What a hostile member served a joiner (reproduced): its weights negated with zeroed AdamW
    moments (cosine -1.00 to the joiner's own), or noise just under the norm bound (10x the
    joiner's own norm plus 2 per value), both passing the bounds on a state."""
    meta, tensors = donor_state(daemon.worker.stage)
    n = len(tensors) // 3
    for i, (_, p) in enumerate(daemon.worker.stage.named_parameters()):
        if kind == "negated":
            tensors[i] = -p.detach().clone()
        else:
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
            tensors[i] = noise * (0.99 * (10 * float(p.norm()) + 2 * p.numel() ** 0.5) / float(noise.norm()))
    if kind == "negated":
        tensors[n:] = [torch.zeros_like(t) for t in tensors[n:]]
    return meta, tensors


def test_a_hostile_state_from_a_lone_donor_is_refused_and_the_donor_named(daemon: PeerDaemon) -> None:
    """One donor, nothing to compare with: the single-donor policy takes a state only as far from
    this peer's own weights as AdamW moves them in the steps between (42 at lr 1e-4: 0.01 per
    value, not a negation's 2x nor the norm bound's noise); the donor is logged, counted and
    reported."""
    for kind in ("negated", "noise"):
        before = [p.detach().clone() for p in daemon.worker.stage.parameters()]
        assert take(daemon, hostile(daemon, kind)) == ["d0"]
        assert all(torch.equal(a, b) for a, b in zip(before, daemon.worker.stage.parameters()))
        assert daemon.worker.version == 0 and daemon.resumed_from == "initial weights"
        assert daemon.state_sync.refused[-1].startswith(
            "d0: no stage mate to compare with, and it is far from this peer's own weights"
        )
    assert "cosine -1.00" in daemon.state_sync.refused[0] and daemon.state_sync.refused_count == 2


def take_judged(daemon: PeerDaemon, *states) -> list[str]:
    """`take`, with each donor's weights' sketches (GetShard SKETCH) served from its state, as witnesses."""
    asked: list[str] = []

    def download(donor: pb.PeerInfo) -> bool:
        asked.append(donor.peer_id)
        meta, tensors = states[int(donor.peer_id[1:])]
        return daemon.state_sync.apply_state(meta, tensors, f"a group member ({donor.peer_id})")

    def weights(donor: pb.PeerInfo, seed: int, size: int) -> list[torch.Tensor]:
        tensors = states[int(donor.peer_id[1:])][1]
        return sketches(tensors[: len(tensors) // 3], seed, size)

    daemon.averager = daemon.averager or FakeAverager()
    daemon.state_sync.load_group_state(
        [pb.PeerInfo(peer_id=f"d{i}", step=50) for i in range(len(states))], download, weights
    )
    return asked


def test_a_state_far_from_what_the_group_holds_is_refused_and_the_next_donor_taken(daemon: PeerDaemon) -> None:
    """Three donors, the first hostile: its two stage mates find it far, it is refused and named,
    and the next (close to the third) is taken. Two donors, the second hostile: one witness
    against one donor is a tie, and the single-donor policy takes the honest one."""
    honest = donor_state(daemon.worker.stage)
    bad = hostile(daemon, "negated")
    assert take_judged(daemon, bad, honest, honest) == ["d0", "d1"]
    assert daemon.worker.version == 42 and daemon.state_sync.refused_count == 1
    assert daemon.state_sync.refused[-1].startswith("d0: far from what 2 of 2 stage mates hold (weight ")


def test_an_honest_donor_against_a_lone_hostile_witness_is_taken(daemon: PeerDaemon) -> None:
    honest = donor_state(daemon.worker.stage)
    assert take_judged(daemon, honest, hostile(daemon, "noise")) == ["d0"]
    assert daemon.worker.version == 42 and daemon.state_sync.refused_count == 0


def test_a_lone_replica_holder_is_judged_by_the_single_donor_policy(daemon: PeerDaemon) -> None:
    """After a whole group's loss one holder serves the stage's state: nobody else to compare
    with, so a negated state is refused (and the holder named), an honest one taken."""
    daemon.averager = FakeAverager()
    holder = pb.PeerInfo(peer_id="h", step=42)
    for state, taken in ((hostile(daemon, "negated"), False), (donor_state(daemon.worker.stage), True)):
        assert (
            daemon.state_sync.load_single(
                holder, lambda h, s=state: daemon.state_sync.apply_state(*s, f"the replica {h.peer_id} holds")
            )
            is taken
        )
    assert daemon.worker.version == 42 and list(daemon.state_sync.refused)[0].startswith(
        "h: no stage mate to compare with"
    )
