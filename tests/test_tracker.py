"""The tracker's rules, driven directly with a fake clock: admission, stage choice by capacity,
moves from a rich stage to a starving one, heartbeat expiry, anchor scheduling, status fields."""

from __future__ import annotations

import json
import math

import pytest

from bootstrap.tracker import JoinRefused, Tracker
from peer import __version__
from peer.config import AnchorConfig, ConfigError, ModelConfig, SpectralConfig, TrainConfig, check_swarm, config_from_dict
from peer.wire import anchormesh_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(anchor_every: int = 0, stages: int = 2, layers: int = 4) -> tuple[Tracker, Clock]:
    clock = Clock()
    cfg = TrainConfig(model=ModelConfig(num_stages=stages, num_layers=layers), anchor=AnchorConfig(every=anchor_every, micro_batches=3))
    return Tracker("run-x", cfg, peer_timeout_s=30.0, move_cooldown_s=20.0, clock=clock), clock


def join(t: Tracker, pid: str) -> pb.Assignment:
    return t.join(pb.JoinRequest(peer_id=pid, grpc_address=f"127.0.0.1:{1000 + len(t.peers)}", code_version=__version__))


def beat(t: Tracker, pid: str, *, capacity: float = 0.0, step: int = 0, state: str = "active") -> pb.Directive:
    p = t.peers[pid]
    info = pb.PeerInfo(peer_id=pid, stage=p.stage, address=p.address, state=state, step=step, capacity_tokens_per_s=capacity)
    return t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=step * 100))


def test_join_checks_run_version_and_duplicates() -> None:
    t, _ = make()
    with pytest.raises(JoinRefused, match="code_version"):
        t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", code_version="0.0.0"))
    with pytest.raises(JoinRefused, match="run_id='other'"):
        t.join(pb.JoinRequest(run_id="other", peer_id="a", grpc_address="h:1", code_version=__version__))
    a = join(t, "a")
    assert a.run_id == "run-x" and (a.layer_start, a.layer_end) == (0, 2)
    assert config_from_dict(json.loads(a.run_config_json)) == t.config
    with pytest.raises(JoinRefused, match="already in the run"):
        join(t, "a")


def test_joiners_fill_stages_then_go_where_capacity_is_lowest() -> None:
    t, _ = make()
    assert [join(t, p).stage for p in ("a", "b")] == [0, 1]
    beat(t, "a", capacity=1000.0)
    beat(t, "b", capacity=400.0)  # stage 1 can do 400 tokens/s, stage 0 1000: stage 1 is the bottleneck
    assert join(t, "c").stage == 1
    beat(t, "c", capacity=400.0)
    assert t.scores() == pytest.approx([1000.0, 800.0])
    assert join(t, "d").stage == 1  # 800 < 1000 still


def test_a_starving_stage_pulls_a_peer_from_the_richest_and_only_one_per_cooldown() -> None:
    t, clock = make()
    for p in ("a", "b", "c", "d"):
        join(t, p)  # stages 0, 1, 0, 1
    for p in ("a", "b", "c", "d"):
        assert beat(t, p, capacity=500.0).kind == pb.Directive.CONTINUE  # new peers are never moved
    clock.t += 21.0
    for p in ("a", "b", "c", "d"):
        assert beat(t, p, capacity=500.0).kind == pb.Directive.CONTINUE  # balanced: nobody moves
    t.leave(pb.LeaveRequest(run_id="run-x", peer_id="b", reason="SIGTERM"))
    t.leave(pb.LeaveRequest(run_id="run-x", peer_id="d", reason="SIGTERM"))
    assert t.status().state == "paused"
    d = beat(t, "a", capacity=500.0)
    assert d.kind == pb.Directive.MOVE and "stage 1" in d.reason
    assert t.peers["a"].state == "left" and "moved to stage 1" in t.peers["a"].reason
    assert beat(t, "c", capacity=500.0).kind == pb.Directive.CONTINUE  # c is stage 0's last peer
    assert join(t, "a").stage == 1  # the moved peer joins again and gets the stage it was moved for
    assert t.status().state == "running" and t.status().stage_moves == 1


def test_a_move_needs_a_real_gain_and_waits_for_the_cooldown() -> None:
    t, clock = make()
    for p in ("a", "b", "c"):
        join(t, p)  # stages 0, 1, 0
    clock.t += 21.0
    # stage 0: 2 x 500, stage 1: 450. Moving one stage-0 peer leaves stage 0 at 500 < 1.5 * 450: stay
    assert beat(t, "a", capacity=500.0).kind == pb.Directive.CONTINUE
    beat(t, "c", capacity=500.0)
    assert beat(t, "b", capacity=450.0).kind == pb.Directive.CONTINUE
    assert beat(t, "a", capacity=500.0).kind == pb.Directive.CONTINUE
    # stage 1 slows down to 100 tokens/s: moving a peer would raise the bottleneck from 100 to 500,
    # and once that has held for the cooldown, the move comes
    beat(t, "b", capacity=100.0)
    assert beat(t, "a", capacity=500.0).kind == pb.Directive.CONTINUE
    clock.t += 21.0
    beat(t, "b", capacity=100.0)
    assert beat(t, "a", capacity=500.0).kind == pb.Directive.MOVE
    assert t.scores()[1] == pytest.approx(600.0)  # the moved peer counts for stage 1 until it is back
    assert join(t, "a").stage == 1
    beat(t, "a", capacity=500.0)
    beat(t, "b", capacity=100.0)
    join(t, "e")  # stage 0 again has 1 peer... the newcomer goes to the lowest score
    assert t.peers["e"].stage == 0
    beat(t, "e", capacity=2000.0)
    clock.t += 5.0
    assert all(beat(t, p, capacity=c).kind == pb.Directive.CONTINUE for p, c in (("c", 500.0), ("e", 2000.0)))  # cooldown


def test_silent_peers_are_marked_dead_and_dropped_from_neighbours() -> None:
    t, clock = make()
    join(t, "a")
    join(t, "b")
    assert [n.peer_id for n in beat(t, "a").neighbours] == ["b"]
    clock.t += 31.0
    d = beat(t, "a")
    assert t.peers["b"].state == "dead" and "no heartbeat" in t.peers["b"].reason
    assert list(d.neighbours) == []
    with pytest.raises(JoinRefused, match="join first"):
        beat(t, "b")


def test_neighbours_include_the_stage_group_but_not_the_peer_itself() -> None:
    t, _ = make()
    for p in ("a", "b", "c"):
        join(t, p)
    assert sorted(n.peer_id for n in beat(t, "a").neighbours) == ["b", "c"]
    assert sorted(n.peer_id for n in beat(t, "b").neighbours) == ["a", "c"]


def test_anchor_jobs_go_to_stage_zero_every_k_steps() -> None:
    t, _ = make(anchor_every=5)
    join(t, "a")
    join(t, "b")
    assert beat(t, "a", step=4).anchor_id == 0
    d = beat(t, "a", step=5)
    assert (d.anchor_id, d.anchor_micro_batches) == (1, 3)
    assert beat(t, "b", step=5).anchor_id == 0  # stage 1 never gets jobs
    assert beat(t, "a", step=6).anchor_id == 0
    assert beat(t, "a", step=10).anchor_id == 2
    s = t.status()
    assert s.anchors_launched == 2 and s.anchor_age_steps == -1  # launched, none folded in yet
    info = pb.PeerInfo(peer_id="b", stage=1, address=t.peers["b"].address, state="active", step=9, anchor_id=1, anchor_bytes_out=500)
    t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=0))
    s = t.status()  # anchor 1 was launched at run step 5; the run is at step 10
    assert (s.anchor_step, s.anchor_age_steps) == (5, 5) and s.anchor_bytes_per_token == pytest.approx(500 / 1000)


def test_anchor_off_schedules_nothing() -> None:
    t, _ = make(anchor_every=0)
    join(t, "a")
    join(t, "b")
    assert beat(t, "a", step=100).anchor_id == 0 and t.status().anchors_launched == 0


def test_swarm_refuses_spectral_modes_that_need_the_masked_twin() -> None:
    with pytest.raises(ConfigError, match="spectral.mode"):
        check_swarm(TrainConfig(anchor=AnchorConfig(every=5), spectral=SpectralConfig(mode="ef")))
    check_swarm(TrainConfig(anchor=AnchorConfig(every=5), spectral=SpectralConfig(mode="paper")))


def test_status_reports_dp_bytes_and_compression() -> None:
    t, _ = make()
    join(t, "a")
    join(t, "b")
    for pid, sent, dense in (("a", 1000, 40_000), ("b", 1000, 20_000)):
        p = t.peers[pid]
        info = pb.PeerInfo(peer_id=pid, stage=p.stage, address=p.address, state="active", step=10, dp_bytes_out=sent, dp_dense_bytes=dense)
        t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=500 if pid == "a" else 0))
    s = t.status()
    assert s.dp_compression == pytest.approx(30.0) and s.dp_bytes_per_token == pytest.approx(2000 / 500)


def test_evaluation_passes_go_to_stage_zero_every_eval_every_steps() -> None:
    t, _ = make()
    assert t.config.pipeline.eval_every == 50
    join(t, "a")
    join(t, "b")
    assert beat(t, "a", step=49).eval_id == 0
    assert beat(t, "a", step=50).eval_id == 1
    assert beat(t, "a", step=51).eval_id == 0
    assert math.isnan(t.status().eval_loss) and t.status().eval_step == -1
    info = pb.PeerInfo(peer_id="b", stage=1, address=t.peers["b"].address, state="active", step=52, eval_id=1, eval_loss=2.5)
    t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=0))
    s = t.status()
    assert (s.eval_loss, s.eval_step) == (2.5, 50)
