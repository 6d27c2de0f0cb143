"""The daemon's parts (peer/daemon/*.py) each on its own: no swarm, no subprocess, no gRPC
server, a two-tensor stage instead of a model. What `PeerDaemon` wires together must hold up
part by part: the state transfer refuses what no honest training gives, checkpoints resume,
routing weighs by capacity and resends, the heartbeat reports and obeys, jobs are scheduled.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from peer.daemon.anchors import AnchorJobs
from peer.daemon.averaging import apply_step, step_lock
from peer.daemon.checkpointing import Checkpointer
from peer.daemon.membership import Membership
from peer.daemon.routing import Router
from peer.daemon.serving import Serving
from peer.daemon.startup import StartupClock
from peer.daemon.state_sync import StateSync
from peer.errors import AnchormeshError, WireError
from peer.pipeline.linkmeter import LinkMeter
from peer.store.checkpoint import ShardCheckpoints
from peer.wire import anchormesh_pb2 as pb


class TinyStage(torch.nn.Module):
    """Two parameters, named like a stage's, with the names a checkpoint gives them."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.b = torch.nn.Parameter(torch.randn(3, generator=g))
        self.index, self.is_first, self.is_last = 1, False, True
        self.hf_names = {"w": "model.layers.0.w", "b": "model.layers.0.b"}


def holder(seed: int = 0, tmp: Path | None = None) -> SimpleNamespace:
    """The peer as the state transfer and checkpointing see it: its fields, nothing else."""
    stage = TinyStage(seed)
    opt = torch.optim.AdamW(stage.parameters(), betas=(0.9, 0.95))
    worker = SimpleNamespace(
        stage=stage,
        optimizer=SimpleNamespace(opt=opt),
        version=0,
        next_mb=0,
        cfg=SimpleNamespace(
            optim=SimpleNamespace(beta1=0.9, beta2=0.95, lr=1e-4), pipeline=SimpleNamespace(micro_batches=4)
        ),
    )
    lock = threading.Lock()
    return SimpleNamespace(
        worker=worker,
        averager=None,
        state_step=-1,
        resumed_from="initial weights",
        reason="",
        step_lock=lambda: lock,
        checkpoints=ShardCheckpoints(tmp, "run", 1, keep=2) if tmp is not None else None,
        steps_done=0,
    )


def offered(h: SimpleNamespace, version: int = 12) -> tuple[dict, list[torch.Tensor]]:
    """A state an honest donor could send: weights moved a little, moments within AdamW's bound."""
    params = [p.detach() + 0.1 for _, p in h.worker.stage.named_parameters()]
    m = [torch.full_like(p, 0.01) for p in params]
    v = [torch.full_like(p, 0.04) for p in params]
    return {"version": version, "adam_step": float(version)}, params + m + v


# -- state_sync -------------------------------------------------------------------------------------
def test_state_sync_applies_a_good_state_whole_and_offers_it_back() -> None:
    h = holder()
    sync = StateSync(h)
    sync.run_clock = (time.monotonic(), 12)
    meta, tensors = offered(h)
    assert sync.apply_state(meta, tensors, source="a group member")
    assert h.state_step == 12 and h.worker.version == 12
    meta2, back = sync.stage_state()
    assert meta2 == {"version": 12, "adam_step": 12.0}
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))
    assert not sync.apply_state(meta, tensors, source="a group member")  # not newer than what it holds


@pytest.mark.parametrize(
    "poison", ["negative_second_moment", "step_past_the_run", "shape", "count", "first_moment_over_bound"]
)
def test_state_sync_refuses_a_bad_state_and_touches_nothing(poison: str, caplog: pytest.LogCaptureFixture) -> None:
    h = holder()
    sync = StateSync(h)
    sync.run_clock = (time.monotonic(), 12)
    meta, tensors = offered(h)
    if poison == "negative_second_moment":
        tensors[4] = -tensors[4]
    elif poison == "step_past_the_run":
        meta = {**meta, "version": 2**40}
    elif poison == "shape":
        tensors[1] = torch.zeros(7)
    elif poison == "count":
        tensors = tensors[:-1]
    else:
        tensors[2] = torch.full_like(tensors[2], 5.0)  # sqrt(v) = 0.2
    before = [p.detach().clone() for p in h.worker.stage.parameters()]
    with caplog.at_level(logging.WARNING):
        assert not sync.apply_state(meta, tensors, source="a group member")
    assert "stage state from a group member ignored" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, h.worker.stage.parameters()))
    assert h.worker.version == 0 and h.state_step == -1 and not h.worker.optimizer.opt.state


def test_state_sync_without_a_donor_says_where_it_resumed_from() -> None:
    h = holder()
    h.worker.version = 20
    StateSync(h).load_group_state([], lambda donor: True)
    assert h.reason == "no stage-group member answered: resumed from initial weights (the run is at step 20)"


# -- checkpointing ----------------------------------------------------------------------------------
def test_checkpointer_writes_and_a_fresh_peer_resumes_from_it(tmp_path: Path) -> None:
    old = holder(seed=1, tmp=tmp_path)
    ck = Checkpointer(old, StateSync(old))
    old.worker.version = 5
    ck.write(wait=True)
    assert old.checkpoints.steps() == []  # initial weights: nothing worth keeping
    old.steps_done = 5
    ck.write(wait=True)
    assert old.checkpoints.steps() == [5] and ck.written == 5 and ck.failures == 0
    assert not list(old.checkpoints.dir.glob("*.tmp"))
    new = holder(seed=2, tmp=tmp_path)
    resumed = Checkpointer(new, StateSync(new))
    resumed.resume()
    assert (
        new.resumed_from == "checkpoint step 5"
        and new.state_step == 5
        and new.worker.version == 5
        and resumed.written == 5
    )
    assert all(torch.equal(a, b) for a, b in zip(old.worker.stage.parameters(), new.worker.stage.parameters()))


def test_a_failed_checkpoint_is_counted_and_the_step_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    h = holder(tmp=tmp_path)
    ck = Checkpointer(h, StateSync(h))
    h.worker.version = h.steps_done = 3

    def full(*_a, **_k) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(h.checkpoints, "save", full)
    with caplog.at_level(logging.ERROR):
        ck.write(wait=True)
    assert (
        ck.failures == 1
        and ck.written == 0
        and "checkpoint at step 3 failed (1 so far), training goes on" in caplog.text
    )
    monkeypatch.undo()
    ck.write(wait=True)
    assert h.checkpoints.steps() == [3] and ck.written == 3 and ck.failures == 1


# -- routing ----------------------------------------------------------------------------------------
def router(excluded: set[str], worker: object | None = None) -> Router:
    transport = SimpleNamespace(usable=lambda dst: dst not in excluded, endpoints={}, meters={})
    r = Router(transport, "me", lambda: worker or SimpleNamespace(stage=SimpleNamespace(index=0), inflight={}))
    r.route_gen = torch.Generator().manual_seed(0)
    return r


def test_a_link_whose_meter_holds_keeps_its_figure_and_is_logged_once(caplog) -> None:
    r = router(set(), SimpleNamespace(stage=SimpleNamespace(index=0), keep_sent={}))
    m = r.transport.meters[("b", "forward")] = LinkMeter()
    for i in range(8):
        m.sent(40_000, now=0.0)
    for i in range(8):
        m.acked(now=0.4 * (i + 1))
    m.sent(40_000, now=time.monotonic() - 30)  # 30 s ago, never acknowledged
    with caplog.at_level(logging.WARNING):
        assert r.links()[0] == pytest.approx(m.bps() * 8 / 1e6) and r.links()[0] > 0
    assert caplog.text.count("link meter of b forward holds its last estimate: no ack for 30 s") == 1


def test_routing_prefers_usable_peers_by_capacity() -> None:
    r = router({"c"})
    r.apply_neighbours(
        pb.Directive(
            neighbours=[
                pb.PeerInfo(peer_id="me", stage=0),
                pb.PeerInfo(peer_id="mate", stage=0),
                pb.PeerInfo(peer_id="a", stage=1, address="h:1", capacity_tokens_per_s=900.0),
                pb.PeerInfo(peer_id="b", stage=1, address="h:2", capacity_tokens_per_s=100.0),
                pb.PeerInfo(peer_id="c", stage=1, address="h:3", capacity_tokens_per_s=1e6),
            ]
        )
    )
    assert r.transport.endpoints["a"] == "h:1" and r.siblings() == ["mate"]
    picks = collections.Counter(r.next_hop() for _ in range(2000))
    assert set(picks) == {"a", "b"} and 0.85 < picks["a"] / 2000 < 0.95  # c is excluded; 9:1 by capacity
    r.neighbours = {}
    with pytest.raises(AnchormeshError, match="no live peer of stage 1"):
        r.next_hop()


def test_routing_sends_less_to_a_next_hop_that_holds_more_or_answers_later(monkeypatch) -> None:
    """Two next-stage peers of equal capacity: one holding three of this peer's micro-batches
    gets a quarter of the other's share; one whose gradients came back 5x later gets a fifth;
    its round trips age out and it is tried again as an equal."""
    import peer.daemon.routing as routing

    now = [100.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: now[0])
    job = lambda dst, sent: SimpleNamespace(dst=dst, sent_s=sent)  # noqa: E731
    w = SimpleNamespace(stage=SimpleNamespace(index=0), inflight={(1, k): job("b", 99.0) for k in range(3)})
    r = router(set(), w)
    r.neighbours = {1: [pb.PeerInfo(peer_id=x, stage=1, capacity_tokens_per_s=500.0) for x in ("a", "b")]}

    def share_of_b() -> float:
        return collections.Counter(r.next_hop() for _ in range(4000))["b"] / 4000

    assert share_of_b() == pytest.approx(1 / 5, abs=0.03)  # weights 1 : 1/4
    r.watch(w)  # b's three are in flight; their gradients come 2 s after they were sent
    now[0] = 101.0
    w.inflight = {(2, 0): job("a", 100.8)}
    r.watch(w)
    now[0] = 101.0 + 0.2
    w.inflight = {(2, 0): job("a", 101.1)}  # sent again: a held it 0.4 s at least
    r.watch(w)
    assert [x for _, x in r.trips["b"]] == [2.0] * 3 and [round(x, 6) for _, x in r.trips["a"]] == [0.4]
    w.inflight = {}
    assert share_of_b() == pytest.approx(0.4 / 2.4, abs=0.03)  # trips 0.4 s against 2 s
    now[0] += routing.TRIPS_WINDOW_S + 1  # nothing heard from either for a while: equals again
    assert share_of_b() == pytest.approx(0.5, abs=0.03)


def test_routing_resends_a_micro_batch_whose_gradient_never_came() -> None:
    sent: list[tuple] = []

    def inject(window: str, step: int, mb: int) -> None:  # as the worker does: in flight again
        sent.append((window, step, mb))
        w.inflight[(step, mb)] = SimpleNamespace(window=window)

    w = SimpleNamespace(
        inflight={(4, 2): SimpleNamespace(window="win")},
        basis_sent={"x": 1},
        replica=0,
        cfg=SimpleNamespace(pipeline=SimpleNamespace(micro_batches=4)),
        inject=inject,
    )
    w.forget_sent = w.basis_sent.clear  # what StageWorker.forget_sent does for the low-rank codec
    r = router(set())
    r.neighbours = {1: [pb.PeerInfo(peer_id="a", stage=1)]}
    assert r.retry_after_s() == 20.0  # nothing measured yet
    r.sent_at[(4, 2)] = time.monotonic() - 30
    r.retry_stale(w)
    assert sent == [("win", 4, 2)] and not w.basis_sent and not r.round_trips
    r.retry_stale(w)
    assert len(sent) == 1  # just sent again: not yet
    del w.inflight[(4, 2)]  # its gradient came: the round trip counts
    r.retry_stale(w)
    assert len(r.round_trips) == 1 and not r.sent_at


# -- membership -------------------------------------------------------------------------------------
clock = [0.0]  # the member's process age, seconds


def member() -> tuple[SimpleNamespace, Membership]:
    clock[0] = 0.0
    from peer.pipeline.bounds import LinkBounds

    bounds = LinkBounds()
    with pytest.raises(WireError):
        bounds.check("backward", "loud", 1.0, 1e9)
    worker = SimpleNamespace(
        stage=SimpleNamespace(index=1),
        version=9,
        inbox_fwd=[1, 2],
        inbox_bwd=[3],
        keep_sent={},
        state_bytes_sent=60,
        bounds=bounds,
        dropped_steps=1,
    )
    stalled = LinkMeter()
    stalled.sent(4096, now=time.monotonic() - 100)  # never acked: the meter holds its estimate
    transport = SimpleNamespace(
        run_id="run",
        bytes_in=100,
        total_bytes=lambda: 250,
        excluding=lambda: ["x1", "x2", "x3", "x4", "x5"],
        endpoints={},
        meters={("next", "forward"): stalled},
        usable=lambda dst: True,
    )
    d = SimpleNamespace(
        peer_id="me",
        address="h:9",
        identity=SimpleNamespace(fingerprint="fp"),
        gate=SimpleNamespace(refused=collections.Counter(a=2, b=1), banned={"old": "x"}),
        transport=transport,
        stop=threading.Event(),
        worker=worker,
        averager=None,
        anchor=None,
        state="active",
        reason="",
        tokens=4096,
        tokens_per_s=12.5,
        capacity=40.0,
        loss=2.5,
        steps_done=0,
        startup_s=0.0,
        move_reason="",
        refused="",
        resumed_from="group step 5",
        startup=StartupClock(lambda: clock[0]),
        replicas=SimpleNamespace(stage=2, step=7, pulls_asked=[]),
        feed=None,
        state_sync=SimpleNamespace(refused=["bad: far"]),
    )
    d.replicas.maybe_pull = d.replicas.pulls_asked.append
    return d, Membership(d, Router(transport, "me", lambda: worker), AnchorJobs())


def test_membership_reports_the_peer_s_figures() -> None:
    d, m = member()
    r = m.report()
    assert (r.run_id, r.tokens, r.peer.peer_id, r.peer.stage, r.peer.step, r.peer.address) == (
        "run",
        4096,
        "me",
        1,
        9,
        "h:9",
    )
    assert (r.peer.queue_depth, r.peer.bytes_in, r.peer.bytes_out, r.peer.refused_calls, r.peer.key_fingerprint) == (
        3,
        100,
        250,
        3,
        "fp",
    )
    assert r.peer.pp_state_bytes_out == 60  # of bytes_out: the codec state its links shipped
    assert list(r.peer.excluding) == ["x1", "x2", "x3", "x4"] and r.peer.dp_rounds == 0 and r.peer.anchor_id == 0
    assert (r.peer.replica_stage, r.peer.replica_step, r.peer.resumed_from) == (2, 7, "group step 5")
    assert list(r.peer.refused_donors) == ["bad: far"]  # the donors whose state it refused, for the tracker to show
    assert [x.split(",")[0] for x in r.peer.refused_senders] == ["loud: 1 refused"] and r.peer.dropped_steps == 1
    assert [x.split(" s:")[0] for x in r.peer.links_held] == ["next forward: no ack for 100"]  # a stalled link, said
    clock[0] = 7.0
    d.startup.begin("join")
    clock[0] = 9.4
    r = m.report()  # before its first step: what it does, for how long, since when; no phases yet
    assert (
        r.peer.reason == "joining: the run's config, its memory plan, the tracker's assignment (2 s; 9 s since start)"
        and not r.peer.startup_phases
    )
    d.startup.begin("state")
    d.reason = "downloading its stage's state from peer-x (40 %)"  # a phase that says more
    assert m.report().peer.reason == "downloading its stage's state from peer-x (40 %) (0 s; 9 s since start)"
    clock[0] = 12.0
    d.startup_s = d.startup.done()
    d.steps_done, d.reason = 1, "waiting for a peer of stage 1"
    r = m.report()
    assert r.peer.reason == "waiting for a peer of stage 1" and r.peer.startup_s == 12.0
    assert [(p.name, round(p.seconds, 1)) for p in r.peer.startup_phases] == [
        ("imports", 7.0),
        ("join", 2.4),
        ("state", 2.6),
    ]


class Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.PERMISSION_DENIED

    def details(self) -> str:
        return "banned"


def test_membership_obeys_the_directives() -> None:
    d, m = member()
    directives = [
        pb.Directive(
            neighbours=[pb.PeerInfo(peer_id="a", stage=2, address="h:1")],
            banned=["fp9"],
            anchor_id=7,
            anchor_micro_batches=2,
            eval_id=3,
            replicate=pb.PeerInfo(peer_id="a", stage=2, address="h:1", step=8),
        ),
        pb.Directive(kind=pb.Directive.MOVE, reason="stage 0 starves"),
    ]
    m.heartbeat(SimpleNamespace(Heartbeat=lambda requests: iter(directives)), 0.01)
    assert d.gate.banned == {"fp9": "banned by the run's operator"}  # the old ban is lifted, in place
    assert (
        [n.peer_id for n in m.router.neighbours[2]] == ["a"]
        and list(m.jobs.anchors) == [(7, 2)]
        and list(m.jobs.evals) == [3]
    )
    assert d.move_reason == "stage 0 starves" and d.stop.is_set()
    assert [t.peer_id for t in d.replicas.pulls_asked] == [
        "a"
    ]  # the copy of the next stage: from whom the tracker named

    d, m = member()

    def refused(requests):
        raise Refused()

    m.heartbeat(SimpleNamespace(Heartbeat=refused), 0.01)
    assert d.refused == "banned" and d.stop.is_set() and not d.move_reason


# -- anchors, averaging, serving --------------------------------------------------------------------
def test_anchor_jobs_become_passes_on_stage_zero() -> None:
    jobs, scheduled = AnchorJobs(), []
    anchor = SimpleNamespace(
        issued=None,
        schedule=lambda i, b: scheduled.append(("anchor", i, len(b))),
        schedule_eval=lambda i, b: scheduled.append(("eval", i, len(b))),
    )
    jobs.take(pb.Directive(anchors_issued=5, anchor_id=5, anchor_micro_batches=3, eval_id=2), anchor)
    assert anchor.issued == 5
    cfg = SimpleNamespace(seed=0, pipeline=SimpleNamespace(micro_batch_size=2, seq_len=8, eval_batches=4))
    feed = SimpleNamespace(anchor_batches=lambda i, n: None, eval_batches=lambda b, n: None)
    jobs.schedule(anchor, feed, cfg)  # nothing trained, no eval windows yet: the jobs wait
    assert scheduled == [] and jobs.anchors and jobs.evals
    feed = SimpleNamespace(
        anchor_batches=lambda i, n: [torch.zeros(2, 9)] * n, eval_batches=lambda b, n: [torch.zeros(b, 9)]
    )
    jobs.schedule(anchor, feed, cfg)
    assert scheduled == [("anchor", 5, 3), ("eval", 2, 4)] and not jobs.anchors and not jobs.evals


def test_a_step_with_an_averager_is_taken_under_its_lock() -> None:
    own, calls = threading.Lock(), []
    averager = SimpleNamespace(lock=threading.Lock(), after_step=lambda v, alone: calls.append(("after", v, alone)))
    w = SimpleNamespace(version=3)

    def step() -> None:
        assert averager.lock.locked() and not own.locked()
        w.version += 1

    w.apply_step = step
    apply_step(w, averager, own, list)  # no stage mates: alone
    assert calls == [("after", 4, True)]
    assert step_lock(averager, own) is averager.lock and step_lock(None, own) is own


def test_serving_answers_before_and_after_the_stage() -> None:
    d = SimpleNamespace(
        peer_id="me",
        state="joining",
        worker=None,
        anchor=None,
        transport=SimpleNamespace(run_id="run"),
        step_lock=threading.Lock,
    )
    s = Serving(d)
    assert (s.ping_info(None).stage, s.ping_info(None).state, s.ping_info(None).run_id) == (0, "joining", "run")
    with pytest.raises(AnchormeshError, match="serves no stage yet"):
        s.shard(None, pb.ShardRequest())
    with pytest.raises(WireError, match="no stage yet"):
        s.validate("forward", object())
    d.worker = SimpleNamespace(stage=SimpleNamespace(index=2), version=7)
    assert (s.ping_info(None).stage, s.ping_info(None).version) == (2, 7)


def test_a_retry_encoded_otherwise_is_a_new_micro_batch_for_the_receiver() -> None:
    """The receiver answers a retry of a micro-batch it took with the gradient it cached, unless
    the retry was encoded otherwise (mask.adapt, a new basis): that gradient would not fit."""
    from peer.pipeline.retries import retry_key
    from peer.wire import anchormesh_pb2 as pb

    def act(k: int, version: int = 3) -> pb.ActivationChunk:
        return pb.ActivationChunk(
            header=pb.MicroBatchHeader(sender="s0", step=20, micro_batch_id=7),
            basis_version=version,
            hidden=pb.TensorPayload(shape=[4, 32, k]),
        )

    assert retry_key(act(4)) == retry_key(act(4))
    assert retry_key(act(4)) != retry_key(act(2)) and retry_key(act(4)) != retry_key(act(4, version=4))
