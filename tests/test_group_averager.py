"""The stage group's background averaging (peer/dp/group.py) over a real hivemind DHT: after a
round both peers hold the mean of what they offered, for fp32 parameters and for 8-bit deltas,
and the local steps taken while the round ran are kept. When rounds are offered (wall-clock slots
the group shares) is tested without hivemind, with a fake clock."""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from peer.dp.group import GroupAverager
from peer.dp.schedule import RoundSchedule, offer_due, round_bytes, slot_period


class FakeClock:
    """Wall-clock seconds that move only when a test says so (the real averaging process keeps real time)."""

    def __init__(self, t: float = 1000.5) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@contextmanager
def two_dhts():
    """Two DHT nodes on loopback, the second bootstrapped from the first; shut down after."""
    import hivemind

    dht_a = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht_b = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in dht_a.get_visible_maddrs()]
    )
    try:
        yield dht_a, dht_b
    finally:
        dht_b.shutdown()
        dht_a.shutdown()


def offer(avgs: list[GroupAverager], clock: FakeClock) -> None:
    """Each averager (every=1) offers a round: its first step starts its schedule, the second,
    1 s later, is in a new 1 s slot."""
    for avg in avgs:
        avg.after_step(1)
    assert all(avg._pending is None for avg in avgs)  # the first offer waits for a slot boundary
    clock.t += 1.0
    for avg in avgs:
        avg.after_step(2)
    assert all(avg._pending is not None for avg in avgs)


def start_round(a: GroupAverager, b: GroupAverager, clock: FakeClock) -> None:
    """Both peers offer a round; returns once both rounds have ended."""
    offer([a, b], clock)
    deadline = time.monotonic() + 60
    while not (a._pending.done() and b._pending.done()):
        assert time.monotonic() < deadline, "no averaging round within 60 s"
        time.sleep(0.1)


def wait_rounds(avgs: list[GroupAverager]) -> None:
    """Until every averager's offered round has ended (60 s at most)."""
    deadline = time.monotonic() + 60
    while not all(avg._pending.done() for avg in avgs):
        assert time.monotonic() < deadline, "no averaging round within 60 s"
        time.sleep(0.1)


@contextmanager
def three_members(prefix: str, compression: str):
    """Three averagers (every=1, peer ids peer-0..2, a shared fake clock) on three DHT nodes, all
    starting from the same seeded weights; yields (init, common, params, avgs, clock), where
    `common` is an update direction the members' training shares. Shut down after."""
    import hivemind

    with two_dhts() as (dht_a, dht_b):
        dht_c = hivemind.DHT(
            start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in dht_a.get_visible_maddrs()]
        )
        avgs: list[GroupAverager] = []
        try:
            torch.manual_seed(0)
            init = [torch.randn(100, 50), torch.randn(20)]
            common = [0.01 * torch.randn_like(t) for t in init]
            params = [[torch.nn.Parameter(t.clone()) for t in init] for _ in range(3)]
            clock = FakeClock()
            for i, (d, ps) in enumerate(zip((dht_a, dht_b, dht_c), params)):
                avgs.append(
                    GroupAverager(
                        d, ps, prefix, every=1, timeout=30.0, compression=compression, peer_id=f"peer-{i}", clock=clock
                    )
                )
            yield init, common, params, avgs, clock
        finally:
            for avg in avgs:
                avg.shutdown()
            dht_c.shutdown()


def same_start(
    dht_a, dht_b, init: list[torch.Tensor], prefix: str, compression: str
) -> tuple[list, list, GroupAverager, GroupAverager, FakeClock]:
    """Two peers' parameters starting from the same weights, and their averagers (every=1, a shared fake clock)."""
    pa = [torch.nn.Parameter(t.clone()) for t in init]
    pb = [torch.nn.Parameter(t.clone()) for t in init]
    clock = FakeClock()
    a = GroupAverager(dht_a, pa, prefix, every=1, timeout=30.0, compression=compression, clock=clock)
    b = GroupAverager(dht_b, pb, prefix, every=1, timeout=30.0, compression=compression, clock=clock)
    return pa, pb, a, b, clock


def at_mean_unless_lost(mean: list[torch.Tensor], own: list[torch.Tensor], avg: GroupAverager) -> list[torch.Tensor]:
    """What a peer must hold after a round: the mean, except where its results were lost (its own values)."""
    if avg.last_lost is None:
        assert avg.partial == 0
        return mean
    assert avg.partial == 1 and any(bool(m.any()) for m in avg.last_lost)
    return [torch.where(lost, o, m) for m, o, lost in zip(mean, own, avg.last_lost)]


@pytest.mark.processes
@pytest.mark.parametrize("compression,tol", [("none", 1e-6), ("int8", 2e-3)])
def test_round_leaves_both_peers_at_the_mean(compression: str, tol: float) -> None:
    with two_dhts() as (dht_a, dht_b):
        torch.manual_seed(0)
        init = [torch.randn(300, 200), torch.randn(50)]  # both peers start from the same weights (same seed)
        pa, pb, a, b, clock = same_start(dht_a, dht_b, init, f"test_{compression}", compression)
        with torch.no_grad():  # different local training: small, different changes
            for p in pa:
                p.add_(0.01 * torch.randn_like(p))
            for p in pb:
                p.add_(0.01 * torch.randn_like(p))
        want = [(x.detach() + y.detach()) / 2 for x, y in zip(pa, pb)]
        own_a, own_b = [p.detach().clone() for p in pa], [p.detach().clone() for p in pb]
        start_round(a, b, clock)
        with torch.no_grad():  # a local step taken while the round ran must survive it
            pa[1].add_(1.0)
        a._finish()
        b._finish()
        assert a.rounds == b.rounds == 1, (a.last_error, b.last_error)
        # under load hivemind now and then loses a few results on the way back (a stream that
        # failed): there each peer keeps its own values, and says so (`last_lost`, `partial`)
        want_a, want_b = at_mean_unless_lost(want, own_a, a), at_mean_unless_lost(want, own_b, b)
        for y, m in zip(pb, want_b):
            assert torch.allclose(y.detach(), m, atol=tol), (y.detach() - m).abs().max()
        assert torch.allclose(pa[0].detach(), want_a[0], atol=tol), (pa[0].detach() - want_a[0]).abs().max()
        assert torch.allclose(pa[1].detach(), want_a[1] + 1.0, atol=tol)
        assert a.bytes_out == int(2 * (2 - 1) / 2 * (300 * 200 + 50) * (1 if compression == "int8" else 4))
        a.shutdown()
        b.shutdown()


@pytest.mark.processes
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_results_lost_on_the_way_back_keep_own_values_and_the_old_base(
    monkeypatch: pytest.MonkeyPatch, compression: str
) -> None:
    """The stream that brings a mate's results back fails (injected: hivemind then keeps this
    peer's own values there and logs only "received N% results"): the round counts as partial,
    the lost coordinates keep this peer's values, the claim check is not fooled into calling it a
    lie, and the lost coordinates keep the old base (int8: their drift is offered again)."""
    from hivemind.averaging.allreduce import AllReduceRunner

    real = AllReduceRunner._communicate_with_peer

    async def lossy(self, peer_id):  # forked into each averaging process with the patch in place
        if peer_id == self.peer_id:
            return await real(self, peer_id)
        container, failed, mate = self.tensor_part_container, [], self.ordered_peer_ids.index(peer_id)
        register = container.register_processed_part

        def drop(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            if peer_index == mate and not failed:  # the first result from the mate: the stream "fails"
                failed.append(part_index)
                raise ConnectionResetError("injected: stream reset")
            register(peer_index, part_index, part)  # hivemind's own fill-in for the failed reducer

        container.register_processed_part = drop
        return await real(self, peer_id)

    monkeypatch.setattr(AllReduceRunner, "_communicate_with_peer", lossy)
    # results are read once this peer's parts are all sent: the injected reset then loses results
    # only, never the mate's inputs (which would stall the mate's own reduction until its timeouts)
    monkeypatch.setattr(AllReduceRunner, "should_delay_results", lambda self, peer_id: True)
    with two_dhts() as (dht_a, dht_b):
        torch.manual_seed(0)
        init = [torch.randn(300, 200), torch.randn(50)]
        pa, pb, a, b, clock = same_start(dht_a, dht_b, init, f"lossy_{compression}", compression)
        with torch.no_grad():
            for p in pa + pb:
                p.add_(0.01 * torch.randn_like(p))
        want = [(x.detach() + y.detach()) / 2 for x, y in zip(pa, pb)]
        own = [p.detach().clone() for p in pa]
        base_before = [t.clone() for t in a._base]
        start_round(a, b, clock)
        a._finish()
        b._finish()
        try:
            assert a.rounds == b.rounds == 1 and a.rejected == b.rejected == 0, (a.last_rejection, b.last_rejection)
            assert a.partial == b.partial == 1
            lost = a.last_lost
            n_lost = sum(int(m.sum()) for m in lost)
            assert 0 < n_lost < sum(p.numel() for p in pa)  # the mate's share, not everything
            tol = 1e-6 if compression == "none" else 2e-3
            for p, m, o, mask in zip(pa, want, own, lost):
                assert torch.allclose(p.detach(), torch.where(mask, o, m), atol=tol)
            for base, before, m, mask in zip(a._base, base_before, want, lost):
                assert torch.equal(base[mask], before[mask])  # lost: the old base
                assert torch.allclose(base[~mask], m[~mask], atol=tol)  # received: the new mean
        finally:
            a.shutdown()
            b.shutdown()


@pytest.mark.processes
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_threads_of_a_forked_averaging_process_start_together_without_breaking_torch() -> None:
    """hivemind forks the averaging process from a peer that set torch's thread count; there
    several executor threads run their first torch op at once. After `after_fork` (what the
    averaging process runs first) none fails; without it most such children hit torch's
    "Invalid thread pool!" assert (measured: 186 of 200)."""
    from peer.dp.hivemind_averager import after_fork

    torch.set_num_threads(1)
    (torch.ones(1_000_000) * 2).sum()  # the parent's pool exists before the fork, as in a peer
    failed = 0
    for _ in range(20):
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery, only an exit code
            code = 1
            try:
                after_fork()
                errors: list[str] = []
                barrier = threading.Barrier(16)

                def first_op() -> None:
                    try:
                        barrier.wait()
                        (torch.ones(200_000) * 2).sum()
                    except Exception as exc:  # noqa: BLE001 (torch's assert is a RuntimeError)
                        errors.append(str(exc))

                threads = [threading.Thread(target=first_op) for _ in range(16)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                code = 1 if errors else 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    assert failed == 0, f"{failed} of 20 forked children failed a torch op"


@pytest.mark.processes
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_an_averaging_process_killed_inside_hivemind_s_allocation_lock_blocks_nobody() -> None:
    """A stuck averaging process is killed and forked again; killed while it held hivemind's
    `SharedBytes` lock (a multiprocessing lock shared by every forked process) it left the peer
    blocked for ever at its next MPFuture. After `after_fork` the child's lock is its own."""
    import signal

    from hivemind.utils.mpfuture import SharedBytes

    from peer.dp.hivemind_averager import after_fork

    pid = os.fork()
    if pid == 0:
        try:
            after_fork()
            SharedBytes._lock.acquire()
            os.kill(os.getpid(), signal.SIGKILL)  # dies holding the lock, as a killed child can
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    assert SharedBytes._lock.acquire(timeout=5), "the parent's lock is still held by the killed child"
    SharedBytes._lock.release()
    assert SharedBytes.next().numel() == 1  # what an MPFuture takes


@pytest.mark.processes
def test_an_averaging_process_that_does_not_start_is_killed_and_forked_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """hivemind waits forever for a forked averaging process that got stuck before it was ready
    (seen now and then in peers whose gRPC threads were live at the fork). The first start here
    is made to time out: it is killed, a second process starts and the averager works."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    from peer.dp import group, group_process

    real = DecentralizedAverager.run_in_background
    started: list[DecentralizedAverager] = []

    def first_one_hangs(self, await_ready: bool = True, timeout: float | None = None) -> None:
        started.append(self)
        if len(started) == 1:
            self.start()  # a real child, as in the hang; then the wait gives up
            raise TimeoutError
        real(self, await_ready=await_ready, timeout=timeout)

    monkeypatch.setattr(DecentralizedAverager, "run_in_background", first_one_hangs)
    monkeypatch.setattr(group_process, "START_TIMEOUT_S", 1.0)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        avg = group.GroupAverager(dht, [torch.nn.Parameter(torch.zeros(4))], "test_restart", every=1)
        assert len(started) == 2 and avg.averager is started[1]
        started[0].join(5)
        assert not started[0].is_alive()  # the stuck child is gone
        assert avg.averager.is_alive()
        assert "did not start within 1s (try 1 of 3)" in caplog.text
        avg.shutdown()
    finally:
        dht.shutdown()


@pytest.mark.processes
@pytest.mark.parametrize("poison", ["nan", "scaled"])
def test_an_implausible_group_mean_is_refused_and_the_weights_stay(poison: str) -> None:
    """Peer b offers NaN or 100x-scaled parameters: the mean a receives is NaN or far outside a's
    own drift since the last mean, so a keeps its weights and counts the refusal."""
    with two_dhts() as (dht_a, dht_b):
        torch.manual_seed(0)
        init = [torch.randn(100, 50), torch.randn(20)]
        pa, pb, a, b, clock = same_start(dht_a, dht_b, init, f"poison_{poison}", "none")
        with torch.no_grad():
            for p in pa:
                p.add_(0.01 * torch.randn_like(p))  # honest local training
            for p in pb:
                p.copy_(torch.full_like(p, float("nan")) if poison == "nan" else 100.0 * p)
        before = [p.detach().clone() for p in pa]
        start_round(a, b, clock)
        a._finish()
        assert a.rejected == 1 and a.rounds == 0, (a.last_error, a.last_rejection)
        if poison == "nan":  # its claim shows it: b is named
            assert "sent NaN or Inf" in a.last_rejection and [x.split(": ")[0] for x in a.suspects] == [
                str(b.averager.peer_id)
            ]
        else:  # in a pair, size alone names nobody (an honest member with an older base looks the same)
            assert "more than 4.0x this peer's own drift" in a.last_rejection and not a.suspects
        assert all(torch.equal(x.detach(), y) for x, y in zip(pa, before))  # untouched
        assert all(
            torch.equal(base, t) for base, t in zip(a._base, init)
        )  # the next delta still counts from the last good mean
        a.shutdown()
        b.shutdown()


@pytest.mark.processes
@pytest.mark.parametrize("attack", ["flipped", "lying"])
def test_a_sign_flipped_update_is_refused_and_its_sender_named(attack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peers train the same way (their updates share a direction, as on one distribution).
    `flipped`: in a group of three, c sends the mirror image of its update, of normal size, and
    commits to it: a refuses the round and names c. `lying` (a pair): b commits to its honest
    values but sends flipped ones: the mean does not match what b reveals, a refuses the round
    and cannot name anyone."""
    import hivemind

    from peer.dp import audit

    honest_commit = audit.commit_claim

    def commit_then_flip(tensors, claim, sign):  # runs in each forked averaging process
        out = honest_commit(tensors, claim, sign)
        if claim.get("peer") == "peer-1" and attack == "lying":
            for t in tensors:
                t.mul_(-1)
        return out

    monkeypatch.setattr(audit, "commit_claim", commit_then_flip)

    with two_dhts() as (dht_a, dht_b):
        dht_c = (
            hivemind.DHT(
                start=True,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=[str(m) for m in dht_a.get_visible_maddrs()],
            )
            if attack == "flipped"
            else None
        )
        try:
            torch.manual_seed(0)
            init = [torch.randn(100, 50), torch.randn(20)]
            common = [0.01 * torch.randn_like(t) for t in init]
            dhts = [dht_a, dht_b] + ([dht_c] if dht_c else [])
            params = [[torch.nn.Parameter(t.clone()) for t in init] for _ in dhts]
            clock = FakeClock()
            avgs = [
                GroupAverager(
                    d, ps, f"flip_{attack}", every=1, timeout=30.0, compression="int8", peer_id=f"peer-{i}", clock=clock
                )
                for i, (d, ps) in enumerate(zip(dhts, params))
            ]
            with torch.no_grad():
                for i, ps in enumerate(params):
                    for p, c, t in zip(ps, common, init):
                        update = c + 0.005 * torch.randn_like(p)
                        p.copy_(t - update if attack == "flipped" and i == 2 else t + update)
            a, bad = avgs[0], avgs[-1]
            before = [p.detach().clone() for p in params[0]]
            offer(avgs, clock)
            wait_rounds(avgs)
            a._finish()
            assert a.rejected == 1 and a.rounds == 0, (a.last_error, a.last_rejection)
            if attack == "flipped":
                assert "points against the rest of the group" in a.last_rejection
                assert [x.split(":")[0] for x in a.suspects] == [str(bad.averager.peer_id)]
            else:
                assert "a member sent other values than it committed to" in a.last_rejection and not a.suspects
            assert all(torch.equal(x.detach(), y) for x, y in zip(params[0], before))
            for avg in avgs:
                avg.shutdown()
        finally:
            if dht_c is not None:
                dht_c.shutdown()


@pytest.mark.processes
def test_a_peer_alone_in_its_stage_offers_no_round() -> None:
    import hivemind

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        clock = FakeClock()
        avg = GroupAverager(dht, [torch.nn.Parameter(torch.zeros(4))], "test_alone", every=1, clock=clock)
        avg.after_step(1)
        clock.t += 1.0  # a new slot: a round would be due
        avg.after_step(2, alone=True)
        assert avg._pending is None  # no matchmaking for a group that cannot form
        avg.after_step(3, alone=False)
        assert avg._pending is None  # no longer alone: the next boundary, where the others offer too
        clock.t += 1.0
        avg.after_step(4, alone=False)
        assert avg._pending is not None
        avg.shutdown()
    finally:
        dht.shutdown()


@pytest.mark.processes
def test_a_round_pending_far_past_its_timeout_is_cancelled_and_the_next_offered() -> None:
    from concurrent.futures import Future

    import hivemind

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        clock = FakeClock()
        avg = GroupAverager(dht, [torch.nn.Parameter(torch.zeros(4))], "test_stuck", every=1, timeout=5.0, clock=clock)
        avg.after_step(1)
        stuck = Future()  # never resolves, like the hivemind round seen pending for minutes
        avg._pending, avg._offered_wall = stuck, time.monotonic() - 100.0
        clock.t += 1.0
        avg.after_step(2)
        assert stuck.cancelled() and avg.failures == 1 and "cancelled" in avg.last_error
        clock.t += 1.0
        avg.after_step(3)
        assert (
            avg._pending is not None and avg._pending is not stuck
        )  # the next round was offered, at the next boundary
        avg.shutdown()
    finally:
        dht.shutdown()


def test_a_big_stage_round_is_given_its_transfer_time_before_it_counts_as_stuck() -> None:
    from types import SimpleNamespace

    tiny = SimpleNamespace(timeout=30.0, numel=400_000, compression="none")
    big = SimpleNamespace(timeout=30.0, numel=750_000_000, compression="none")  # a 1.5B model's stage, fp32
    assert 90 < GroupAverager.stuck_after_s(tiny) < 92  # the tiny run: 3 timeouts, as before
    assert GroupAverager.stuck_after_s(big) == pytest.approx(90 + 750e6 * 4 / 1.25e6)  # 3 GB at 10 Mbit/s: 40 min


# --- when rounds are offered: wall-clock slots (RoundSchedule), no hivemind -------------------


def ticks(
    first_step: int, start: float, step_s: float, until: float, jitter: float = 0.0, seed: int = 0
) -> list[tuple[int, float]]:
    """(local step, wall time) of a peer's steps: `step_s` apart, each off by up to `jitter` of it."""
    rng, out, step, t = random.Random(seed), [], first_step, start
    while t < until:
        out.append((step, t))
        step += 1
        t += step_s * (1 + jitter * rng.uniform(-1, 1))
    return out


def offers(schedule: RoundSchedule, steps: list[tuple[int, float]], round_s: float = 2.2) -> list[float]:
    """Feed a peer's steps to its schedule; an offered round stays pending for `round_s` (a
    matched round: matchmaking and all-reduce). The times of its offers."""
    out: list[float] = []
    for step, t in steps:
        if schedule.tick(step, t, hold=bool(out) and t < out[-1] + round_s):
            schedule.offered(step, t)
            out.append(t)
    return out


def test_slot_period_is_the_need_rounded_up_to_a_power_of_two() -> None:
    assert slot_period(10, 0.61, 0, None, 0.0) == 8.0  # 6.1 s
    assert slot_period(10, 0.8, 0, None, 0.0) == 8.0  # a power of two already
    assert slot_period(10, 0.81, 0, None, 0.0) == 16.0
    assert slot_period(1, 3.0, 0, None, 0.0) == 4.0
    assert slot_period(10, 0.01, 0, None, 0.0) == slot_period(10, None, 0, None, 0.0) == 1.0  # at least 1 s


def test_the_run_s_minimum_period_spaces_rounds_of_fast_steps() -> None:
    """dp.min_period_s: a hivemind round costs the same CPU however small, so fast steps of a
    small model do not set a round every second; slower needs are not affected."""
    assert slot_period(5, 0.1, 0, None, 0.0) == 1.0  # hivemind's own floor
    assert slot_period(5, 0.1, 0, None, 0.0, min_period_s=8.0) == 8.0
    assert (
        slot_period(5, 0.1, 0, None, 0.0, min_period_s=5.0) == 8.0
    )  # rounded up to a power of two: members' slots nest
    assert slot_period(10, 2.5, 0, None, 0.0, min_period_s=8.0) == 32.0  # 25 s of steps: above the floor
    sched = RoundSchedule(5, 0, min_period_s=8.0)
    assert sched.period_s == 8.0 and "the minimum" in sched.period_reason
    t = 1000.0
    for step in range(1, 40):
        t += 0.1
        sched.tick(step, t)
    assert sched.period_s == 8.0


def test_step_times_within_2x_give_periods_whose_boundaries_nest() -> None:
    """Members estimate the period each from its own step time: within 2x of each other, the
    longer period's boundaries are all boundaries of the shorter one, so they meet at each."""
    for i in range(60):
        x = 0.05 * 1.07**i
        for f in (1.0, 1.3, 1.7, 2.0):
            p, q = slot_period(10, x, 0, None, 0.0), slot_period(10, x * f, 0, None, 0.0)
            assert q in (p, 2 * p)
            t0 = 1_700_000_000.3  # epoch seconds, as the peers' clocks
            edges = {
                k: [math.floor((t0 + k) / s) > math.floor((t0 + k - 1) / s) for s in (p, q)] for k in range(1, 300)
            }
            assert all(in_p for in_p, in_q in edges.values() if in_q)


def test_the_link_bound_sets_the_period_on_a_slow_link() -> None:
    nbytes = round_bytes(5_000_000, 2, "int8")  # a 5M-parameter stage: 5 MB per round
    assert slot_period(10, 0.3, nbytes, 1.25e6, 0.2) == 32.0  # 10 Mbit/s, a fifth of it: 20 s
    assert slot_period(10, 0.3, nbytes, 125e6, 0.2) == 4.0  # 1 Gbit/s: 0.2 s; the 3 s of steps set it
    assert (
        slot_period(10, 0.3, nbytes, None, 0.2) == slot_period(10, 0.3, nbytes, 1.25e6, 0.0) == 4.0
    )  # no link known / no share: no bound
    link: list[float | None] = [1.25e6]
    sched = RoundSchedule(10, nbytes, link_bps=lambda: link[0], link_share=0.2)
    for i in range(3):
        sched.tick(i, 1000.0 + 0.3 * i)
    assert (sched.period_s, sched.period_reason) == (32.0, "32 s: link 1.25 MB/s, share 0.2")
    link[0] = None  # the caller knows nothing now: the rate of this peer's own rounds counts
    sched.measured_bps = 2.5e6
    sched.tick(3, 1000.9)
    assert (sched.period_s, sched.period_reason) == (16.0, "16 s: link (measured) 2.5 MB/s, share 0.2")


def test_the_period_follows_the_step_time_with_hysteresis_and_logs_changes(caplog: pytest.LogCaptureFixture) -> None:
    sched = RoundSchedule(10, 0)
    t = 1000.0
    with caplog.at_level(logging.INFO, logger="peer.dp.schedule"):
        for step_s, n in ((0.61, 30), (0.85, 40), (0.75, 40), (0.3, 60)):
            for _ in range(n):
                t += step_s
                sched.tick(0, t)
            if step_s == 0.61:
                assert (sched.period_s, sched.period_reason) == (8.0, "8 s: 10 steps x 0.61 s")
            elif step_s == 0.85:
                assert sched.period_s == 16.0
            elif step_s == 0.75:  # 7.5 s would fit in 8 s, but not clearly: no flapping at the edge
                assert sched.period_s == 16.0 and "held until under 7.2 s" in sched.period_reason
            else:
                assert (sched.period_s, sched.period_reason) == (4.0, "4 s: 10 steps x 0.30 s")
    changes = [r.getMessage() for r in caplog.records if "a round every" in r.getMessage()]
    assert [c.split(" s:")[0].rsplit(" ", 1)[1] for c in changes] == [
        "8",
        "16",
        "8",
        "4",
    ]  # down by way of 8 s as the average falls


def test_offer_due_needs_every_steps_and_a_boundary_since() -> None:
    assert offer_due(10, 10, since=1003.9, now=1008.1, period_s=8.0)  # 1008 = 126 x 8
    assert not offer_due(9, 10, 1003.9, 1008.1, 8.0)
    assert not offer_due(12, 10, 1008.1, 1015.9, 8.0)  # no boundary since
    assert offer_due(12, 10, 1008.1, 1016.0, 8.0)  # on the boundary counts


def test_the_first_offer_waits_for_a_boundary_after_its_steps() -> None:
    """10 steps of 0.61 s from 1003.5 end at 1009: past the boundary at 1008, so the first offer
    waits for the one at 1016 (where the group offers), then one at each boundary."""
    sched = RoundSchedule(10, 0)
    got = offers(sched, ticks(500, 1003.5, 0.61, 1040))
    assert sched.period_s == 8.0 and len(got) == 3
    assert [math.floor(t / 8) * 8 for t in got] == [1016, 1024, 1032] and all(t % 8 < 0.61 for t in got)


def test_two_peers_with_different_step_counts_and_step_times_offer_in_the_same_slots() -> None:
    a, b = RoundSchedule(10, 0), RoundSchedule(10, 0)
    at = offers(a, ticks(5000, 1000.13, 0.61, 1400, jitter=0.05, seed=1))
    bt = offers(b, ticks(17, 1013.7, 0.66, 1400, jitter=0.05, seed=2))  # joined later, slower
    assert a.period_s == b.period_s == 8.0
    slot = lambda t: math.floor(t / 8)  # noqa: E731
    assert [slot(t) for t in at if slot(t) >= slot(bt[0])] == [slot(t) for t in bt]  # the same slots
    assert all(t % 8 < 0.66 * 1.05 for t in at + bt)  # each within a step of the boundary
    assert len(bt) >= 45


def test_a_peer_with_half_the_period_meets_the_other_at_each_of_its_boundaries() -> None:
    a, b = RoundSchedule(10, 0), RoundSchedule(10, 0)
    at = offers(a, ticks(300, 1000.13, 0.35, 1400, jitter=0.05, seed=1))  # 3.5 s -> 4 s
    bt = offers(b, ticks(17, 1013.7, 0.61, 1400, jitter=0.05, seed=2))  # 6.1 s -> 8 s
    assert (a.period_s, b.period_s) == (4.0, 8.0) and len(bt) >= 45
    a_at = {math.floor(t / 8) for t in at if t % 8 < 0.4}  # a's offers right after a multiple of 8
    assert all(math.floor(t / 8) in a_at for t in bt)


def test_no_offer_while_alone_and_the_next_waits_for_a_boundary() -> None:
    sched = RoundSchedule(1, 0)
    assert not sched.tick(1, 1000.5)
    assert not sched.tick(2, 1001.5, hold=True)  # due, but alone (or the last round is pending)
    assert not sched.tick(3, 1001.9)  # a boundary passed while held: an offer now would meet nobody
    assert sched.tick(4, 1002.1)


def test_bad_schedule_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="every .* must be >= 1, not 0"):
        RoundSchedule(0, 0)
    with pytest.raises(ValueError, match=r"link_share .* must be in \[0, 1\], not 1.5"):
        RoundSchedule(10, 0, link_share=1.5)


def test_matchmaking_stops_after_half_a_period_and_the_group_forms_a_step_after_the_boundary() -> None:
    def avg(period_s: float, step_s: float | None) -> SimpleNamespace:
        ns = SimpleNamespace(timeout=30.0, schedule=SimpleNamespace(period_s=period_s, step_s=step_s))
        ns.match_timeout_s = lambda: GroupAverager.match_timeout_s(ns)
        return ns

    assert GroupAverager.match_timeout_s(avg(16.0, 0.6)) == 8.0
    assert GroupAverager.match_timeout_s(avg(2.0, 0.1)) == 5.0  # at least 5 s
    assert GroupAverager.match_timeout_s(avg(128.0, 1.0)) == 30.0  # at most the timeout
    assert GroupAverager.match_window_s(avg(16.0, 0.6)) == pytest.approx(1.6)  # 1 s + a step
    assert GroupAverager.match_window_s(avg(16.0, None)) == 1.0
    assert GroupAverager.match_window_s(avg(16.0, 4.0)) == 4.0  # below the matchmaking timeout


def test_the_link_is_measured_only_from_an_all_reduce_seen_over_several_steps() -> None:
    clock = FakeClock(1010.0)
    ns = SimpleNamespace(
        _allreduce_seen=(3, 1008.0), _ticks=8, _clock=clock, schedule=SimpleNamespace(measured_bps=None)
    )
    GroupAverager._measure_link(ns, 4_000_000)  # 5 steps, 2 s
    assert ns.schedule.measured_bps == 2e6 and ns._allreduce_seen is None
    ns._allreduce_seen, ns._ticks = (7, 1009.5), 9  # 2 steps: mostly the error of seeing it once a step
    GroupAverager._measure_link(ns, 4_000_000)
    assert ns.schedule.measured_bps == 2e6


@pytest.mark.processes
def test_a_group_of_three_takes_the_trimmed_mean_and_an_outsized_member_moves_nothing() -> None:
    """c sends an update 3.9x the others' (under the 4x naming limit, so the round is taken):
    with hivemind's weighted mean it would drag the group along; the trimmed mean (the median of
    three, every member weighing 1) leaves the result between the honest members."""
    from peer.dp.robust import trimmed_mean

    with three_members("trimmed", "none") as (init, common, params, avgs, clock):
        with torch.no_grad():
            for i, ps in enumerate(params):
                for p, c, t in zip(ps, common, init):
                    p.copy_(t + (3.9 * c if i == 2 else c + 0.002 * torch.randn_like(p)))
        offered = [[p.detach().clone() for p in ps] for ps in params]
        offer(avgs, clock)
        wait_rounds(avgs)
        avgs[0]._finish()
        assert avgs[0].rounds == 1 and avgs[0].rejected == 0, (avgs[0].last_error, avgs[0].last_rejection)
        for k, p in enumerate(params[0]):
            want = trimmed_mean(torch.stack([o[k] for o in offered]))
            plain = torch.stack([o[k] for o in offered]).mean(0)
            torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)
            assert (plain - want).norm() > 10 * (p.detach() - want).norm() + 1e-3  # the plain mean would be elsewhere


def test_trimmed_mean_drops_the_extremes_per_coordinate() -> None:
    from peer.dp.robust import trim_count, trimmed_mean

    assert [trim_count(n) for n in (1, 2, 3, 8, 16, 17)] == [0, 0, 1, 1, 2, 2]
    x = torch.tensor([[1.0, -5.0], [2.0, 0.0], [100.0, 1.0]])
    assert torch.equal(trimmed_mean(x), torch.tensor([2.0, 0.0]))
    assert torch.equal(trimmed_mean(x[:2]), x[:2].mean(0))  # a pair: the plain mean


@pytest.mark.processes
def test_a_round_with_a_peer_the_tracker_does_not_list_is_refused() -> None:
    """The backstop behind the member gate: a round that reached a member with an outsider in it
    (here the averaging process was not handed the member list, as between a change and the
    pipe's delivery) is refused by the host, which keeps its weights and names the stranger by
    its hivemind id."""
    with two_dhts() as (dht_a, dht_b):
        torch.manual_seed(0)
        init = [torch.randn(30, 20)]
        pa, pb = [torch.nn.Parameter(init[0].clone())], [torch.nn.Parameter(init[0] + 1.0)]
        clock = FakeClock()
        a = GroupAverager(dht_a, pa, "members", every=1, timeout=30.0, compression="none", clock=clock)
        outsider = GroupAverager(dht_b, pb, "members", every=1, timeout=30.0, compression="none", clock=clock)
        a._members = {str(a.averager.peer_id)}  # what the tracker says (the host only: see above)
        before = pa[0].detach().clone()
        start_round(a, outsider, clock)
        a._finish()
        assert a.rejected == 1 and a.rounds == 0 and "not members of this stage group" in a.last_rejection
        assert a.suspects and a.suspects[-1].startswith(str(outsider.averager.peer_id))
        assert torch.equal(pa[0].detach(), before)
        a.shutdown()
        outsider.shutdown()


def test_a_member_hivemind_left_out_is_told_apart_from_a_lie() -> None:
    """hivemind drops a sender whose stream fails and reduces the others' parts: a result equal to
    the others' trimmed mean names the dropped member; any other mismatch (or a pair, or this peer
    dropped) stays a lie nobody can be attributed."""
    from peer.dp.claims import left_out
    from peer.dp.robust import trimmed_mean

    torch.manual_seed(0)
    common = torch.randn(64)
    claims = {"me": common + 0.1 * torch.randn(64), "b": common + 0.1 * torch.randn(64), "c": -common}
    assert left_out(claims, (claims["me"] + claims["b"]) / 2, 1e-3, "me") == "c"
    assert (
        left_out(claims, trimmed_mean(torch.stack([claims["b"], claims["c"]])), 1e-3, "me") is None
    )  # only "me" could explain it
    assert left_out(claims, (claims["me"] + claims["b"]) / 2 + 0.05, 1e-3, "me") is None
    assert left_out({"me": claims["me"], "b": claims["b"]}, claims["me"], 1e-3, "me") is None


@pytest.mark.processes
def test_a_non_member_gets_no_round_and_nobody_gets_the_state_through_hivemind() -> None:
    """hivemind's averaging RPCs answer anyone who reaches a peer's libp2p address. Once the
    tracker names the stage group's members, a non-member's rounds reach nothing of the member's;
    and hivemind's state download answers nobody, member or not (a joiner's state comes over the
    Stage service, size-capped: peer/daemon/replicas.py)."""
    with two_dhts() as (dht_a, dht_b):
        torch.manual_seed(0)
        init = [torch.randn(60, 40), torch.randn(10)]
        pa = [torch.nn.Parameter(t + 1.0) for t in init]  # a has trained: not b's weights
        pb = [torch.nn.Parameter(t.clone()) for t in init]
        clock = FakeClock()
        a = GroupAverager(dht_a, pa, "gate", every=1, timeout=8.0, clock=clock)
        b = GroupAverager(dht_b, pb, "gate", every=1, timeout=8.0, clock=clock)
        try:
            a_id, b_id = str(a.averager.peer_id), str(b.averager.peer_id)
            a.members = {a_id}  # the tracker lists only a: b is an outsider
            start_round(a, b, clock)
            a._finish()
            b._finish()
            assert a.rounds == 0  # a refused b's join and b's parts, and sent nothing to a group holding b
            assert all(torch.equal(p.detach(), t + 1.0) for p, t in zip(pa, init))
            # b (not gated: its tracker named nobody) may count a round of its own values: nothing of a's reached it
            assert all(torch.allclose(p.detach(), t, atol=1e-6) for p, t in zip(pb, init)), b.rounds
            a.members = {a_id, b_id}  # b joined the run
            a.averager.allow_state_sharing = True  # even declared as a donor in the DHT, a hands out nothing
            deadline = time.monotonic() + 20
            while (
                found := dht_b.get("gate.all_averagers", latest=True)
            ) is None or a.averager.peer_id.to_bytes() not in found.value:
                assert time.monotonic() < deadline, "the donor never declared itself"
                time.sleep(0.2)
            assert b.averager.load_state_from_peers(timeout=5.0) is None
        finally:
            a.shutdown()
            b.shutdown()
