"""Lies at the bounds, driven on the tracker with a fake clock: a member reporting exactly what
the report bound allows, against a run whose honest members step at 1 step/s. The bound comes
from the rate the other members were seen at, and the run's step, its token budget, the donor
order, a joiner's start step and the restore source after a group loss take only what several
reports (or the tracker's own records) support."""

from __future__ import annotations

from test_replicas import replica_beat
from test_tracker import Clock, beat, join, make

from bootstrap.support import RATE_FACTOR, RATE_FLOOR, RATE_WINDOW_S
from bootstrap.tracker import Tracker
from peer.capacity import MAX_STEPS_PER_S, STEP_SLACK
from peer.config import ModelConfig, TrainConfig
from peer.wire import anchormesh_pb2 as pb


def run_with_liar(seconds: int, budget_steps: int) -> tuple[Tracker, Clock, dict[str, str], int]:
    """Stage 0: a liar and an honest member; stage 1: an honest member. Every second each honest
    member steps once; the liar claims the most its previous accepted report allows (the old
    bound, 100 steps/s, while that is accepted; else the measured rate's bound). Returns the
    tracker, its clock, the roles and the per-step tokens."""
    clock = Clock()
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4))
    per_step = cfg.pipeline.micro_batches * cfg.pipeline.micro_batch_size * cfg.pipeline.seq_len
    cfg.token_budget = budget_steps * per_step
    t = Tracker("run-x", cfg, peer_timeout_s=30.0, clock=clock)
    for pid in ("p0", "p1", "p2"):
        join(t, pid)
    stage0 = sorted(p.peer_id for p in t.peers.values() if p.stage == 0)
    one = next(p.peer_id for p in t.peers.values() if p.stage == 1)
    assert len(stage0) == 2
    roles = {"liar": stage0[0], "honest0": stage0[1], "honest1": one}

    def send(pid: str, step: int) -> pb.Directive:
        info = pb.PeerInfo(
            peer_id=pid,
            stage=t.peers[pid].stage,
            state="active",
            step=step,
            capacity_tokens_per_s=100.0,
            tokens_per_s=per_step,
        )
        return t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=step * per_step))

    liar = 0
    for second in range(1, seconds + 1):
        clock.t += 1.0
        send(roles["honest0"], second), send(roles["honest1"], second)
        for rate in (MAX_STEPS_PER_S, RATE_FACTOR * 1.0 + RATE_FLOOR):  # the old bound, else the new one
            before = t.peers[roles["liar"]].refused_reports
            if send(roles["liar"], liar + int(rate)).kind == pb.Directive.STOP:
                return t, clock, roles, per_step
            if t.peers[roles["liar"]].refused_reports == before:
                liar += int(rate)
                break
    return t, clock, roles, per_step


def test_a_member_at_the_report_bound_neither_ends_the_run_nor_leads_the_donors() -> None:
    """On a constant bound the liar's 100 steps/s spend a budget of 100,000 honest seconds in
    1,000 s, set the run's step and every joiner's start step and lead its donors."""
    t, _, roles, per_step = run_with_liar(seconds=1_200, budget_steps=100_000)
    st = t.status()
    assert st.state == "running", st.reason
    assert st.step <= 1_200 + STEP_SLACK  # the run's step: what the honest members' reports support
    assert st.tokens <= (1_200 + STEP_SLACK) * per_step * 2  # two stage-0 members, each at most what others support
    assert t.peers[roles["liar"]].refused_reports > 0 and "steps/s" in t.peers[roles["liar"]].last_refusal
    a = join(t, "joiner")
    if a.stage == 0:
        assert a.donors[0].peer_id == roles["honest0"]
    assert a.start_step <= 1_200 + STEP_SLACK


def test_the_report_bound_follows_the_rate_the_run_was_measured_at() -> None:
    """Before any window of reports the constant bound holds; once the others were seen at 1
    step/s, a claim of 100 steps/s is refused naming the measured bound, and an honest member
    stepping twice as fast as the others is still taken."""
    t, clock = make(stages=2, layers=4)
    join(t, "a"), join(t, "b")
    for s in range(1, int(RATE_WINDOW_S) + 3):
        clock.t += 1.0
        beat(t, "a", step=s), beat(t, "b", step=s)
    clock.t += 1.0
    beat(t, "a", step=t.peers["a"].step + 100)
    assert t.peers["a"].refused_reports == 1 and f"{RATE_FACTOR + RATE_FLOOR:.3g} steps/s" in t.peers["a"].last_refusal
    clock.t += 1.0
    beat(t, "a", step=t.peers["a"].step + 4)  # 2 steps/s over the two seconds since its last accepted report
    assert t.peers["a"].refused_reports == 1


def test_the_restore_source_is_chosen_from_the_trackers_records_not_a_claimed_step() -> None:
    """Stage 1's group dies. A stage-0 member the tracker never told to copy stage 1 claims the
    newest replica (on a claimed step it would be the restore source); the holder the tracker
    told to copy it, at the step the tracker saw its source at, is chosen."""
    t, _ = make(stages=2, layers=4)
    for pid in ("a", "b", "c", "d", "e"):
        join(t, pid)
    zero = sorted(p.peer_id for p in t.peers.values() if p.stage == 0)
    ones = sorted(p.peer_id for p in t.peers.values() if p.stage == 1)
    assert len(zero) == 3
    for pid in [*ones, zero[1]]:
        beat(t, pid, step=20)
    assert replica_beat(t, zero[0], step=20, replica_stage=1, replica_step=15).replicate.peer_id in ones
    assert not replica_beat(t, zero[2], step=20, replica_stage=1, replica_step=20).HasField(
        "replicate"
    )  # only two per stage copy
    for pid in ones:
        t.leave(pb.LeaveRequest(peer_id=pid))
    a = join(t, "new")
    assert a.stage == 1 and (a.restore_from.peer_id, a.restore_from.step) == (zero[0], 15)
    # a told holder's claim past what its source was seen at counts only up to that (plus the slack)
    t2, _ = make(stages=2, layers=4)
    join(t2, "a"), join(t2, "b")
    z, o = (next(p.peer_id for p in t2.peers.values() if p.stage == s) for s in (0, 1))
    beat(t2, o, step=10)
    replica_beat(t2, z, step=100, replica_stage=1, replica_step=10 + STEP_SLACK + 40)
    t2.leave(pb.LeaveRequest(peer_id=o))
    assert join(t2, "new").restore_from.step == 10 + STEP_SLACK


def test_a_donor_a_joiner_refused_is_named_in_the_status() -> None:
    from peer.client.problems import problems
    from peer.client.view import status_dict

    t, _ = make(stages=2, layers=4)
    join(t, "a"), join(t, "b"), join(t, "c")
    beat(t, "a", step=5), beat(t, "b", step=5)
    info = pb.PeerInfo(
        peer_id="c",
        stage=t.peers["c"].stage,
        state="active",
        step=5,
        refused_donors=["a: far from what 2 of 2 stage mates hold (weight w: cosine -1.00)"],
    )
    t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=500))
    rows = {p.peer_id: p for p in t.status().peers}
    assert rows["a"].donor_flagged == 1 and list(rows["c"].refused_donors) == list(info.refused_donors)
    assert any(
        "a (stage 0) served a stage state 1 joiner(s) refused: far from" in x for x in problems(status_dict(t.status()))
    )


def test_the_runs_step_never_goes_back_when_a_supporting_member_leaves() -> None:
    t, clock = make(stages=2, layers=4)
    join(t, "a"), join(t, "b")
    clock.t += 1.0
    beat(t, "a", step=100), beat(t, "b", step=100)
    assert t.status().step == 100
    t.leave(pb.LeaveRequest(peer_id="b"))  # a's 100 is no longer supported by a live report
    assert t.status().step == 100


def test_refused_senders_dropped_steps_and_held_link_estimates_are_in_the_status() -> None:
    """A sender refused again and again stalls its micro-batches: the status says who, how often
    and why, and the dashboard lists it, with any step dropped for a non-finite gradient and any
    link whose meter holds its last estimate (a stalled link: no ack)."""
    from peer.client.problems import problems
    from peer.client.view import status_dict

    t, _ = make(stages=2, layers=4)
    join(t, "a"), join(t, "b")
    beat(t, "a", step=5)
    why = "a: 13 refused, newest: forward: a value of magnitude 2e+15 exceeds the cap 1e+15 (security.max_activation_value)"
    info = pb.PeerInfo(
        peer_id="b",
        stage=t.peers["b"].stage,
        state="active",
        step=5,
        refused_senders=[why] * 9,
        dropped_steps=2,
        links_held=["a forward: no ack for 12 s: 2 messages in flight"],
    )
    t.report(pb.PeerReport(run_id="run-x", peer=info, tokens=500))
    row = status_dict(t.status())["peers"]
    b = next(p for p in row if p["id"] == "b")
    assert b["refused_senders"] == [why] * 4 and b["dropped_steps"] == 2  # the tracker keeps 4
    said = problems(status_dict(t.status()))
    assert f"b (stage {info.stage}) refuses messages from {why}" in said
    assert any("dropped 2 step(s) for a non-finite gradient" in x for x in said)
    assert f"b (stage {info.stage}) holds its link estimate of a forward: no ack for 12 s: 2 messages in flight" in said
