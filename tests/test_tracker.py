"""The tracker's rules, driven directly with a fake clock: admission, stage choice by capacity,
moves from a rich stage to a starving one, heartbeat expiry, anchor scheduling, status fields."""

from __future__ import annotations

import json
import math

import pytest

from bootstrap.roster import JoinRefused
from bootstrap.tracker import Tracker
from peer.capacity import MAX_CAPACITY_FACTOR, MAX_STEPS_PER_S
from peer.config import AnchorConfig, ConfigError, ModelConfig, SpectralConfig, TrainConfig, check_swarm
from peer.runtoml import config_from_dict
from peer.wire import anchormesh_pb2 as pb
from peer.wire.version import build_fields, wire_version


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(anchor_every: int = 0, stages: int = 2, layers: int = 4) -> tuple[Tracker, Clock]:
    clock = Clock()
    cfg = TrainConfig(
        model=ModelConfig(num_stages=stages, num_layers=layers),
        anchor=AnchorConfig(every=anchor_every, micro_batches=3),
    )
    return Tracker("run-x", cfg, peer_timeout_s=30.0, move_cooldown_s=20.0, clock=clock), clock


def join(t: Tracker, pid: str) -> pb.Assignment:
    return t.join(pb.JoinRequest(peer_id=pid, grpc_address=f"127.0.0.1:{1000 + len(t.peers)}", **build_fields()))


def beat(t: Tracker, pid: str, *, capacity: float = 0.0, step: int = 0, state: str = "active") -> pb.Directive:
    p = t.peers[pid]
    info = pb.PeerInfo(
        peer_id=pid, stage=p.stage, address=p.address, state=state, step=step, capacity_tokens_per_s=capacity
    )
    return t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=step * 100))


def test_join_checks_run_version_and_duplicates() -> None:
    t, _ = make()
    # another wire version, or none (a build older than wire versions): refused, both versions named
    with pytest.raises(JoinRefused, match=rf"wire_version=w1-0123456789: .* {wire_version()}"):
        t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", **{**build_fields(), "wire_version": "w1-0123456789"}))
    with pytest.raises(JoinRefused, match=r"wire_version=none \(anchormesh 0.0.0 predates"):
        t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", code_version="0.0.0"))
    # a build without the run's codec: refused, naming it
    with pytest.raises(JoinRefused, match="codec.scheme='transform', which this peer's build does not have"):
        t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", **{**build_fields(), "codecs": ["mask", "lowrank"]}))
    with pytest.raises(JoinRefused, match="run_id='other'"):
        t.join(pb.JoinRequest(run_id="other", peer_id="a", grpc_address="h:1", **build_fields()))
    a = join(t, "a")
    assert a.run_id == "run-x" and (a.layer_start, a.layer_end) == (0, 2)
    assert config_from_dict(json.loads(a.run_config_json)) == t.config
    with pytest.raises(JoinRefused, match="already in the run"):
        join(t, "a")
    # with identity keys: another key may not take a live id; the same key is the same peer, restarted
    k1, k2 = bytes(range(32)), bytes(range(1, 33))
    t.join(pb.JoinRequest(peer_id="k", grpc_address="h:2", **build_fields()), k1)
    with pytest.raises(JoinRefused, match="already in the run"):
        t.join(pb.JoinRequest(peer_id="k", grpc_address="h:3", **build_fields()), k2)
    t.join(pb.JoinRequest(peer_id="k", grpc_address="h:4", **build_fields()), k1)
    assert t.peers["k"].address == "h:4" and t.peers["k~1"].state == "left" and "restarted" in t.peers["k~1"].reason


def test_joiners_fill_stages_then_go_where_capacity_is_lowest() -> None:
    t, _ = make()
    assert [join(t, p).stage for p in ("a", "b")] == [0, 1]
    beat(t, "a", capacity=1000.0)
    beat(t, "b", capacity=400.0)  # stage 1 can do 400 tokens/s, stage 0 1000: stage 1 is the bottleneck
    assert join(t, "c").stage == 1
    beat(t, "c", capacity=400.0)
    assert t.scores() == pytest.approx([1000.0, 800.0])
    assert join(t, "d").stage == 1  # 800 < 1000 still


def moves(t: Tracker, peers: dict[str, float]) -> list[tuple[str, pb.Directive]]:
    """Heartbeat each peer once (capacity as given); the ones told to move."""
    out = []
    for pid, cap in peers.items():
        d = beat(t, pid, capacity=cap)
        if d.kind == pb.Directive.MOVE:
            out.append((pid, d))
    return out


def test_a_starving_stage_pulls_a_peer_from_the_richest_and_only_one_per_cooldown() -> None:
    t, clock = make()
    for p in ("a", "b", "c", "d"):
        join(t, p)  # stages 0, 1, 0, 1
    assert moves(t, dict.fromkeys("abcd", 500.0)) == []  # new peers are never moved
    clock.t += 21.0
    assert moves(t, dict.fromkeys("abcd", 500.0)) == []  # balanced: nobody moves
    t.leave(pb.LeaveRequest(run_id="run-x", peer_id="b", reason="SIGTERM"))
    t.leave(pb.LeaveRequest(run_id="run-x", peer_id="d", reason="SIGTERM"))
    assert t.status().state == "paused"
    moved = moves(t, {"a": 500.0, "c": 500.0})
    assert len(moved) == 1 and "stage 1" in moved[0][1].reason  # one of the two, not both
    pid = moved[0][0]
    assert t.peers[pid].state == "left" and "moved to stage 1" in t.peers[pid].reason
    assert join(t, pid).stage == 1  # the moved peer joins again and gets the stage it was moved for
    s = t.status()
    assert s.state == "running" and s.stage_moves == 1
    # its earlier record stays in the roster under a suffixed id, so run totals do not drop
    assert sorted(p.peer_id for p in s.peers if p.peer_id.startswith(pid)) == [pid, f"{pid}~1"]


def test_the_donor_is_the_richest_stage_with_two_peers() -> None:
    t, clock = make(stages=3, layers=3)
    for p in ("a", "b", "c", "d"):
        join(t, p)  # stages 0, 1, 2, then d: lowest score
    t.peers["d"].stage = 1  # stage 0: a (fast), stage 1: b, d, stage 2: c
    clock.t += 21.0
    moves(t, {"a": 2000.0, "b": 300.0, "c": 300.0, "d": 300.0})
    t.leave(pb.LeaveRequest(run_id="run-x", peer_id="c", reason="SIGTERM"))
    # stage 0 scores highest but has one peer; stage 1 has two: one of them goes to stage 2
    moved = moves(t, {"a": 2000.0, "b": 300.0, "d": 300.0})
    assert len(moved) == 1 and moved[0][0] in ("b", "d") and "stage 2" in moved[0][1].reason


def test_the_best_move_is_not_blocked_by_a_peer_whose_move_would_not_help() -> None:
    t, clock = make()
    for p in ("a", "b", "c"):
        join(t, p)  # stages 0, 1, 0
    clock.t += 21.0
    # stage 0 = {a: 1000, c: 100}, stage 1 = {b: 100}: moving c doubles the bottleneck, moving a would not help
    assert moves(t, {"a": 1000.0, "b": 100.0, "c": 100.0}) == []
    clock.t += 21.0
    moved = moves(t, {"a": 1000.0, "b": 100.0, "c": 100.0})
    assert [m[0] for m in moved] == ["c"]


def test_a_move_needs_a_real_gain_and_waits_for_the_cooldown() -> None:
    t, clock = make()
    for p in ("a", "b", "c"):
        join(t, p)  # stages 0, 1, 0
    clock.t += 21.0
    # stage 0: 2 x 500, stage 1: 450. Moving one stage-0 peer leaves stage 0 at 500 < 1.5 * 450: stay
    assert moves(t, {"a": 500.0, "b": 450.0, "c": 500.0}) == []
    assert moves(t, {"a": 500.0, "b": 450.0, "c": 500.0}) == []
    # stage 1 slows down to 100 tokens/s: moving a peer would raise the bottleneck from 100 to 500,
    # and only once that has held for the cooldown does the move come
    assert moves(t, {"b": 100.0, "a": 500.0, "c": 500.0}) == []
    clock.t += 21.0
    moved = moves(t, {"b": 100.0, "a": 500.0, "c": 500.0})
    assert len(moved) == 1
    pid = moved[0][0]
    assert t.scores()[1] == pytest.approx(600.0)  # the moved peer counts for stage 1 until it is back
    assert join(t, pid).stage == 1
    other = "a" if pid == "c" else "c"
    beat(t, pid, capacity=500.0)
    join(t, "e")  # stage 0 (500) vs stage 1 (600): the newcomer goes to the lowest score
    assert t.peers["e"].stage == 0
    # e is fast; stage 0 = 2500, stage 1 = 600: a move would pay, but the cooldown since the
    # last move and e's age both hold it back
    clock.t += 5.0
    assert moves(t, {other: 500.0, "e": 2000.0, "b": 100.0, pid: 500.0}) == []


def test_silent_peers_are_marked_dead_and_dropped_from_neighbours() -> None:
    t, clock = make()
    join(t, "a")
    join(t, "b")
    assert list(beat(t, "a").neighbours) == []  # b has not reported yet: it may not serve yet
    beat(t, "b")
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
    for p in ("a", "b", "c"):
        beat(t, p)
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
    info = pb.PeerInfo(
        peer_id="b", stage=1, address=t.peers["b"].address, state="active", step=9, anchor_id=1, anchor_bytes_out=500
    )
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
        info = pb.PeerInfo(
            peer_id=pid,
            stage=p.stage,
            address=p.address,
            state="active",
            step=10,
            dp_bytes_out=sent,
            dp_dense_bytes=dense,
        )
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
    info = pb.PeerInfo(
        peer_id="b", stage=1, address=t.peers["b"].address, state="active", step=52, eval_id=1, eval_loss=2.5
    )
    t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=0))
    s = t.status()
    assert (s.eval_loss, s.eval_step) == (2.5, 50)


def test_averaging_suspects_are_named_by_run_peer_id_and_counted() -> None:
    t, _ = make()
    for pid, hid in (("a", "12D3KooWA"), ("b", "12D3KooWB")):
        t.join(
            pb.JoinRequest(
                peer_id=pid, grpc_address="h:1", **build_fields(), dht_maddrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{hid}"]
            )
        )
    t.peers["b"].stage = 0  # one stage group
    info = pb.PeerInfo(
        peer_id="a",
        stage=0,
        state="active",
        dp_suspects=[
            "12D3KooWB: its update points against the rest of the group (cosine -0.93)",
            "12D3KooWZ: sent NaN or Inf",
        ],
    )
    t.report(pb.PeerReport(run_id="run-x", peer=info))
    beat(t, "b")
    peers = {p.peer_id: p for p in t.status().peers}
    assert list(peers["a"].dp_suspects) == [
        "b: its update points against the rest of the group (cosine -0.93)",
        "unknown DHT peer 12D3KooWZ: sent NaN or Inf",
    ]
    assert (peers["b"].dp_flagged, peers["a"].dp_flagged) == (1, 0)
    t.peers["b"].key = bytes(range(32)).hex()
    t.ban("b", "sign-flipped updates")
    assert list(beat(t, "a").banned_dht) == [
        "12D3KooWB"
    ]  # stage mates refuse rounds that include its averaging process


def test_a_peer_gets_only_a_stage_its_memory_fits() -> None:
    """Stage choice by memory plan: a small card gets the stage it fits even when another stage
    is emptier; a card no stage fits is refused with both figures, and the status says so."""
    t, _ = make(stages=3, layers=6)
    gib = 2**30

    def ask(pid: str, memory_gib: float, needs_gib: list[float]) -> pb.Assignment:
        return t.join(
            pb.JoinRequest(
                peer_id=pid,
                grpc_address=f"h:{len(t.peers)}",
                **build_fields(),
                device="cuda:0 Test GPU bf16",
                memory_bytes=int(memory_gib * gib),
                stage_memory_bytes=[int(n * gib) for n in needs_gib],
            )
        )

    needs = [9.0, 6.0, 12.0]  # the embeddings and the head make the ends heavier
    assert ask("small", 8.0, needs).stage == 1  # fits stage 1 only, though stages 0 and 2 are empty
    assert ask("mid", 10.0, needs).stage == 0  # fits 0 and 1; stage 0 is emptier
    assert ask("big", 24.0, needs).stage == 2
    assert join(t, "no-plan").stage in (0, 1, 2)  # an old peer without a plan: any stage
    with pytest.raises(
        JoinRefused,
        match=r"tiny on cuda:0 Test GPU bf16: 4.0 GiB, the smallest stage \(stage 1\) needs 6.0 GiB.*activation_checkpointing",
    ):
        ask("tiny", 4.0, needs)
    with pytest.raises(JoinRefused, match="3 stages"):
        ask("wrong", 4.0, [1.0])
    st = t.status()
    assert list(st.unfit) == ["tiny on cuda:0 Test GPU bf16: 4.0 GiB, the smallest stage (stage 1) needs 6.0 GiB"]
    row = {p.peer_id: p for p in st.peers}["small"]
    assert (row.device, row.memory_bytes, row.memory_plan_bytes) == ("cuda:0 Test GPU bf16", 8 * gib, 6 * gib)
    assert "tiny" not in t.peers


def test_implausible_reports_are_refused_and_end_nothing() -> None:
    """A member reporting step 2^40, 10^12 tokens or a step going back: its figures are not taken
    (the run's step, tokens and budget stay), it is counted and shown. A huge capacity is clipped
    to the bound, the rest of its report taken."""
    clock = Clock()
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4), token_budget=10**9)
    t = Tracker("run-x", cfg, peer_timeout_s=30.0, clock=clock)
    join(t, "a"), join(t, "b")
    per_step = cfg.pipeline.micro_batches * cfg.pipeline.micro_batch_size * cfg.pipeline.seq_len

    def report(step: int, tokens: int, capacity: float = 100.0) -> pb.Directive:
        clock.t += 1.0
        info = pb.PeerInfo(peer_id="a", stage=0, state="active", step=step, capacity_tokens_per_s=capacity)
        return t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=tokens))

    assert report(10, 10 * per_step).kind == pb.Directive.CONTINUE
    assert report(2**40, 11 * per_step).kind == pb.Directive.CONTINUE  # not STOP, not the run's step
    assert report(11, 10**12).kind == pb.Directive.CONTINUE  # the budget is not spent by a claim
    report(5, 12 * per_step)  # a step going back
    st = t.status()
    row = {p.peer_id: p for p in st.peers}["a"]
    assert (st.step, st.tokens, st.state) == (10, 10 * per_step, "running")
    assert row.refused_reports == 3 and row.capacity_tokens_per_s == 100.0
    assert "step 5 is below" in t.peers["a"].last_refusal
    report(12, 12 * per_step, capacity=1e15)  # a capacity no peer has: clipped, the step taken
    assert t.status().step == 12 and t.peers["a"].refused_reports == 3
    assert 100.0 < t.peers["a"].capacity <= MAX_CAPACITY_FACTOR * MAX_STEPS_PER_S * per_step
    assert report(13, 13 * per_step).kind == pb.Directive.CONTINUE and t.status().step == 13  # honest figures go on


def test_a_refused_step_is_taken_once_the_time_since_the_last_true_report_allows_it() -> None:
    """A peer whose step ran ahead of the bound (it trained while unseen) reports every second:
    the bound grows from its last report taken as true, not from its last report, so it is taken
    within (gap - slack) / rate seconds instead of being refused for ever."""
    clock = Clock()
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4))
    t = Tracker("run-x", cfg, peer_timeout_s=30.0, clock=clock)
    join(t, "a"), join(t, "b")
    per_step = cfg.pipeline.micro_batches * cfg.pipeline.micro_batch_size * cfg.pipeline.seq_len
    step = 10

    def report() -> int:
        clock.t += 1.0
        info = pb.PeerInfo(peer_id="a", stage=0, state="active", step=step, capacity_tokens_per_s=100.0)
        t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=step * per_step))
        return t.status().step

    assert report() == 10
    step = 10 + 500  # 500 steps ahead: over 50 + 100 steps/s x 1 s
    assert report() == 10 and t.peers["a"].refused_reports == 1
    seen = [report() for _ in range(5)]
    assert seen[-1] == 510 and t.peers["a"].refused_reports < 6


def test_an_honest_tiny_stage_may_claim_more_capacity_than_the_pipeline_steps() -> None:
    """Capacity is what one stage could compute if it never waited: a tiny model's stage may
    exceed 100 steps/s of tokens; 10x that is clipped to the bound, and the report is taken."""
    clock = Clock()
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4))
    t = Tracker("run-x", cfg, peer_timeout_s=30.0, clock=clock)
    join(t, "a"), join(t, "b")
    per_step = cfg.pipeline.micro_batches * cfg.pipeline.micro_batch_size * cfg.pipeline.seq_len
    for step, capacity, taken in (
        (1, 150.0 * per_step, 150.0 * per_step),
        (2, 2000.0 * per_step, MAX_CAPACITY_FACTOR * MAX_STEPS_PER_S * per_step),
    ):
        clock.t += 1.0
        t.report(
            pb.PeerReport(
                run_id="run-x",
                peer=pb.PeerInfo(peer_id="a", stage=0, state="active", step=step, capacity_tokens_per_s=capacity),
                tokens=step * per_step,
            )
        )
        assert t.peers["a"].capacity == taken and t.peers["a"].step == step and t.peers["a"].refused_reports == 0


def test_a_run_that_stalled_takes_its_members_reports_again_when_it_moves() -> None:
    """A stage lost its peer for a while: both members were measured at 0 steps/s, so the bound
    on rates is the floor (1 step/s). When the stage is back the members step fast and report
    their capacity as it is (far over that bound): the reports are taken with the rates clipped,
    the run's step and tokens move and the run ends at its budget. Refusing them wedged the run
    (no report taken, so no new rate measured, so the bound never rose)."""
    clock = Clock()
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4), token_budget=60 * 256)
    cfg.pipeline.micro_batches, cfg.pipeline.micro_batch_size, cfg.pipeline.seq_len = 2, 4, 32
    t = Tracker("run-x", cfg, peer_timeout_s=300.0, clock=clock)
    join(t, "a"), join(t, "b")

    def both(step: int, capacity: float, rate: float) -> pb.Directive:
        out = None
        for pid in ("a", "b"):
            info = pb.PeerInfo(
                peer_id=pid,
                stage=t.peers[pid].stage,
                state="active",
                step=step,
                capacity_tokens_per_s=capacity,
                tokens_per_s=rate,
            )
            out = t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=step * 256))
        return out

    for step in range(0, 41, 4):  # 4 steps/s, then 30 s without a step
        clock.t += 1.0
        both(step, 5000.0, 1000.0)
    for _ in range(30):
        clock.t += 1.0
        both(40, 5000.0, 0.0)
    assert max(p.rate for p in t.peers.values()) == 0.0
    clock.t += 1.0
    d = both(60, 9000.0, 4000.0)  # 20 steps at once, capacity and tokens/s over the stalled bound
    assert t.status().step == 60 and all(p.refused_reports == 0 for p in t.peers.values())
    assert all(0 < p.capacity < 9000.0 for p in t.peers.values())  # clipped, not dropped
    assert d.kind == pb.Directive.STOP and t.status().state == "done"


def test_directives_and_join_replies_carry_the_newest_issued_anchor_id() -> None:
    t, clock = make(anchor_every=2)
    join(t, "a"), join(t, "b")
    beat(t, "b")
    d = beat(t, "a", step=2)
    assert d.anchor_id == 1 and d.anchors_issued == 1
    assert beat(t, "b").anchors_issued == 1  # every stage learns the ceiling: priors above it are forged
    # a joiner learns it from its Join reply, before its first heartbeat (else it takes any id until then)
    assert join(t, "c").anchors_issued == 1


def test_directives_list_the_stage_groups_hivemind_ids() -> None:
    t, _ = make(stages=2)
    for pid, hid in (("a", "QmA"), ("b", "QmB"), ("c", "QmC")):
        t.join(
            pb.JoinRequest(
                peer_id=pid, grpc_address=f"h:{pid}", **build_fields(), dht_maddrs=[f"/ip4/1.2.3.4/tcp/1/p2p/{hid}"]
            )
        )
    stage_of = {pid: t.peers[pid].stage for pid in "abc"}
    d = beat(t, "a")
    assert set(d.member_dht) == {f"Qm{p.upper()}" for p in "abc" if stage_of[p] == stage_of["a"]}


def test_a_joined_peer_has_time_to_load_its_stage_before_its_first_heartbeat() -> None:
    """A real model takes a minute or more to load before the first heartbeat: the peer stays
    "joining" (status says it is loading) up to load_grace_s; once it has reported, silence for
    peer_timeout_s is death as before. Without the grace it was declared dead, joined again and
    loaded again, for ever."""
    t, clock = make()
    join(t, "a")
    join(t, "b")
    beat(t, "b")
    clock.t += 120.0  # a is loading; b went silent
    t._expire()
    assert t.peers["a"].state == "joining" and t.peers["b"].state == "dead"
    assert t.status().peers[0].reason == "loading its stage (120s since it joined)"
    beat(t, "a")
    clock.t += 31.0
    t._expire()
    assert t.peers["a"].state == "dead" and "no heartbeat for 31.0s" in t.peers["a"].reason
    join(t, "c")
    clock.t += t.load_grace_s + 1
    t._expire()
    assert t.peers["c"].state == "dead" and "no first heartbeat after joining" in t.peers["c"].reason


def test_a_peer_s_excluded_next_hops_reach_the_status_capped() -> None:
    """What a peer's sends route around (its transport's exclusions) is shown per peer, at most
    4 entries of 300 characters whatever the report holds."""
    clock = Clock()
    t = Tracker("run-x", TrainConfig(model=ModelConfig(num_stages=2, num_layers=4)), peer_timeout_s=30.0, clock=clock)
    join(t, "a"), join(t, "b")
    said = [f"b{i}: its forward stream took 64 messages without acknowledging them (100 s left)" for i in range(6)]
    info = pb.PeerInfo(peer_id="a", stage=0, state="active", step=1, excluding=said[:5] + ["x" * 5000])
    t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=0))
    row = {p.peer_id: p for p in t.status().peers}["a"]
    assert list(row.excluding) == said[:4]
    info = pb.PeerInfo(peer_id="a", stage=0, state="active", step=2, excluding=["x" * 5000], reason="y" * 5000)
    t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=0))
    row = {p.peer_id: p for p in t.status().peers}["a"]
    assert [len(x) for x in row.excluding] == [300] and len(row.reason) == 300  # the reason is capped too
    t.report(pb.PeerReport(run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active", step=3), tokens=0))
    assert list({p.peer_id: p for p in t.status().peers}["a"].excluding) == []  # the exclusion ended


def test_a_peer_s_startup_time_reaches_the_status_and_nonsense_does_not() -> None:
    clock = Clock()
    t = Tracker("run-x", TrainConfig(model=ModelConfig(num_stages=2, num_layers=4)), peer_timeout_s=30.0, clock=clock)
    join(t, "a")
    for sent, shown in ((12.5, 12.5), (float("nan"), 0.0), (-3.0, 0.0), (1e12, 0.0)):
        t.report(
            pb.PeerReport(
                run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active", step=1, startup_s=sent), tokens=0
            )
        )
        assert t.status().peers[0].startup_s == shown


def test_a_peer_s_startup_phases_reach_the_status_bounded() -> None:
    t = Tracker("run-x", TrainConfig(model=ModelConfig(num_stages=2, num_layers=4)), peer_timeout_s=30.0, clock=Clock())
    join(t, "a")
    sent = [
        pb.StartupPhase(name="imports", seconds=4.0),
        pb.StartupPhase(name="dht", seconds=float("nan")),
        pb.StartupPhase(name="x" * 500, seconds=-1.0),
        *[pb.StartupPhase(name=f"p{i}", seconds=0.5) for i in range(40)],
    ]
    t.report(
        pb.PeerReport(
            run_id="run-x",
            peer=pb.PeerInfo(peer_id="a", stage=0, state="active", step=1, startup_s=9.0, startup_phases=sent),
            tokens=0,
        )
    )
    shown = t.status().peers[0].startup_phases
    assert [(p.name, p.seconds) for p in shown[:2]] == [
        ("imports", 4.0),
        ("p0", 0.5),
    ]  # NaN and negative seconds dropped
    assert len(shown) == 14  # of the first 16 sent, the two nonsense ones dropped


def test_the_status_shows_each_peers_build() -> None:
    """A peer's build (VERSION+COMMIT, from its Join) is kept per peer and shown in the status:
    two checkouts of one release in a run are told apart."""
    from peer.build import build
    from peer.client.status import render
    from peer.client.view import status_dict

    t, _ = make()
    join(t, "a")
    t.join(pb.JoinRequest(peer_id="b", grpc_address="h:2", **{**build_fields(), "code_version": "0.1.0+abcdef0"}))
    s = t.status()
    assert {p["id"]: p["build"] for p in status_dict(s)["peers"]} == {"a": build(), "b": "0.1.0+abcdef0"}
    table = render(s)
    assert build() in table and "0.1.0+abcdef0" in table
