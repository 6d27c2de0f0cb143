"""A stage whose whole group dies comes back from the replica another stage's peer keeps
(peer/daemon/replicas.py): the tracker's rules with a fake clock, the state's shard codec, the
pull pause; real processes in tests/test_swarm_replica.py."""

from __future__ import annotations

import pytest
import torch
from test_tracker import beat, join, make

from peer.daemon.replicas import Replicas
from peer.store.shard import ShardError, state_from_tensors, state_tensors
from peer.wire import anchormesh_pb2 as pb


def replica_beat(t, pid: str, *, step: int, replica_stage: int, replica_step: int) -> pb.Directive:
    p = t.peers[pid]
    info = pb.PeerInfo(
        peer_id=pid,
        stage=p.stage,
        address=p.address,
        state="active",
        step=step,
        replica_stage=replica_stage,
        replica_step=replica_step,
    )
    return t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=step * 100))


def test_each_peer_is_told_to_copy_the_next_stage_from_its_most_trained_peer() -> None:
    t, _ = make(stages=3, layers=6)
    for pid in ("a", "b", "c", "d"):
        join(t, pid)
    by_stage = {s: [p for p in t.peers.values() if p.stage == s] for s in range(3)}
    assert [len(v) for v in by_stage.values()] == [2, 1, 1]
    a0, a1 = (p.peer_id for p in by_stage[0])
    b, c = by_stage[1][0].peer_id, by_stage[2][0].peer_id
    beat(t, a0, step=9), beat(t, a1, step=7), beat(t, c, step=8)
    assert beat(t, b, step=8).replicate.peer_id == c  # stage 1 copies stage 2
    got = beat(t, c, step=8).replicate  # the last stage copies stage 0, its most-trained peer
    assert (got.peer_id, got.stage, got.step, got.address) == (a0, 0, 9, t.peers[a0].address)
    assert (
        beat(t, a0, step=9).replicate.peer_id == beat(t, a1, step=7).replicate.peer_id == b
    )  # both keep a copy of stage 1, its one peer
    assert not beat(t, a0, step=9, state="joining").HasField("replicate")  # a joiner copies nothing
    t1, _ = make(stages=1, layers=2)
    join(t1, "solo")
    assert not beat(t1, "solo", step=3).HasField("replicate")  # one stage: nothing to copy


def test_two_peers_of_a_stage_keep_a_copy_each_from_another_source() -> None:
    """A copy is 12 bytes per parameter: a big group's peers do not all pull, nor from one source."""
    t, _ = make(stages=2, layers=4)
    for pid in ("a", "b", "c", "d", "e", "f"):
        join(t, pid)
    zero = sorted(p.peer_id for p in t.peers.values() if p.stage == 0)
    one = sorted(p.peer_id for p in t.peers.values() if p.stage == 1)
    assert len(zero) == len(one) == 3
    for i, pid in enumerate(one):
        beat(t, pid, step=10 + i)
    got = {pid: beat(t, pid, step=12).replicate for pid in zero}
    copying = {pid: r.peer_id for pid, r in got.items() if r.peer_id}
    assert set(copying) == set(zero[:2])  # the first two by id; the third keeps none
    assert sorted(copying.values()) == sorted(one[1:])  # from the two most-trained, one each


def test_a_joiner_of_a_stage_with_no_live_peer_restores_from_the_newest_replica() -> None:
    t, clock = make(stages=2, layers=4)
    for pid in ("a", "b", "c"):
        join(t, pid)
    zero = [p.peer_id for p in t.peers.values() if p.stage == 0]
    one = [p.peer_id for p in t.peers.values() if p.stage == 1][0]
    beat(t, one, step=20)  # serving: the tracker tells stage 0's peers to copy it (the evidence a restore is chosen by)
    replica_beat(t, zero[0], step=20, replica_stage=1, replica_step=12)
    replica_beat(t, zero[1], step=20, replica_stage=1, replica_step=15)
    assert not join(t, "while-alive").HasField("restore_from")  # its group lives: the group hands the state
    t.leave(pb.LeaveRequest(peer_id="while-alive"))
    t.leave(pb.LeaveRequest(peer_id=one))  # the whole stage-1 group is gone
    a = join(t, "new")
    assert a.stage == 1 and a.start_step == 20
    assert (a.restore_from.peer_id, a.restore_from.step, a.restore_from.stage) == (zero[1], 15, 0)
    clock.t += 1


def test_a_replica_claimed_past_the_run_is_not_believed() -> None:
    t, _ = make(stages=2, layers=4)
    join(t, "a"), join(t, "b")
    zero = next(p.peer_id for p in t.peers.values() if p.stage == 0)
    replica_beat(t, zero, step=10, replica_stage=1, replica_step=2**40)
    assert (t.peers[zero].replica_stage, t.peers[zero].replica_step) == (0, 0)
    replica_beat(t, zero, step=10, replica_stage=7, replica_step=5)  # no stage 7 in this run
    assert t.peers[zero].replica_step == 0
    replica_beat(t, zero, step=10, replica_stage=1, replica_step=9)
    assert (t.peers[zero].replica_stage, t.peers[zero].replica_step) == (1, 9)
    assert t.status().peers[[p.peer_id for p in t.status().peers].index(zero)].replica_step == 9


def test_the_state_travels_as_a_shard_and_only_whole() -> None:
    names = ["w", "b"]
    tensors = [torch.randn(3, 2), torch.randn(2), torch.randn(3, 2), torch.randn(2), torch.rand(3, 2), torch.rand(2)]
    packed = state_tensors({"version": 42, "adam_step": 40.0}, names, tensors)
    meta, back = state_from_tensors(packed, names)
    assert meta == {"version": 42, "adam_step": 40.0} and all(torch.equal(x, y) for x, y in zip(tensors, back))
    with pytest.raises(ShardError, match="1 tensors missing"):
        state_from_tensors({k: v for k, v in packed.items() if k != "exp_avg_sq.b"}, names)
    with pytest.raises(ShardError, match="1 unknown"):
        state_from_tensors({**packed, "param.extra": torch.zeros(1)}, names)
    with pytest.raises(ShardError):
        state_from_tensors(packed, ["w", "b", "c"])  # another stage's layout


def test_a_pull_waits_its_pause_and_at_least_nine_times_its_own_duration() -> None:
    now = [0.0]

    class Slow(Replicas):
        took = 0.0

        def fetch(self, holder, stage=None):
            now[0] += self.took
            raise ShardError("the holder went away")

    r = Slow(transport=None, peer_id="me", clock=lambda: now[0])
    r.configure("run-x", every_s=5.0, state_dir=None, own_state_bytes=1000)
    target = pb.PeerInfo(peer_id="src", stage=1, address="h:1", step=10)
    assert not r.due(target)  # the first copy after one pause
    now[0] += 5.0
    assert r.due(target) and not r.due(None) and not r.due(pb.PeerInfo(peer_id="src", stage=1, address="h:1"))
    r.took = 2.0
    assert not r.pull(target) and r.failures == 1
    now[0] += 17.9
    assert not r.due(target)  # 2 s pull: 18 s before the next one, not the 5 s pause
    now[0] += 0.2
    assert r.due(target)
    r.stage, r.step = 1, 10
    assert not r.due(target)  # nothing newer than the copy held
    r.every_s = 0.0
    assert not r.due(pb.PeerInfo(peer_id="src", stage=1, address="h:1", step=11))  # pulls off


def test_a_joiner_gets_its_serving_stage_mates_most_trained_first_as_donors() -> None:
    t, _ = make(stages=1, layers=2)
    for pid, step in (("a", 5), ("b", 9), ("c", 7), ("d", 8), ("e", 6)):
        join(t, pid)
        beat(t, pid, step=step)
    beat(t, "e", step=6, state="joining")  # still loading: it has nothing to give yet
    donors = join(t, "new").donors
    # most-trained first by what several reports support: b's 9 no other member reaches counts as
    # d's 8, and a claim above the others goes after the one they support
    assert [(d.peer_id, d.step) for d in donors] == [("d", 8), ("b", 9), ("c", 7), ("a", 5)]
    assert all(d.address == t.peers[d.peer_id].address for d in donors)
