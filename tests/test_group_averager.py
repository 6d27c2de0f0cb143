"""The stage group's background averaging (peer/dp/group.py) over a real hivemind DHT: after a
round both peers hold the mean of what they offered, for fp32 parameters and for 8-bit deltas,
and the local steps taken while the round ran are kept."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch

from peer.dp.group import GroupAverager


@contextmanager
def two_dhts():
    """Two DHT nodes on loopback, the second bootstrapped from the first; shut down after."""
    import hivemind

    dht_a = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht_b = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in dht_a.get_visible_maddrs()])
    try:
        yield dht_a, dht_b
    finally:
        dht_b.shutdown()
        dht_a.shutdown()


def start_round(a: GroupAverager, b: GroupAverager) -> None:
    """Both peers offer a round after step 1; returns once both rounds have ended."""
    a.after_step(1)
    b.after_step(1)
    deadline = time.monotonic() + 60
    while not (a._pending.done() and b._pending.done()):
        assert time.monotonic() < deadline, "no averaging round within 60 s"
        time.sleep(0.1)


@pytest.mark.parametrize("compression,tol", [("none", 1e-6), ("int8", 2e-3)])
def test_round_leaves_both_peers_at_the_mean(compression: str, tol: float) -> None:
    with two_dhts() as (dht_a, dht_b):
        torch.manual_seed(0)
        init = [torch.randn(300, 200), torch.randn(50)]  # both peers start from the same weights (same seed)
        pa = [torch.nn.Parameter(t.clone()) for t in init]
        pb = [torch.nn.Parameter(t.clone()) for t in init]
        a = GroupAverager(dht_a, pa, f"test_{compression}", every=1, timeout=30.0, compression=compression)
        b = GroupAverager(dht_b, pb, f"test_{compression}", every=1, timeout=30.0, compression=compression)
        with torch.no_grad():  # different local training: small, different changes
            for p in pa:
                p.add_(0.01 * torch.randn_like(p))
            for p in pb:
                p.add_(0.01 * torch.randn_like(p))
        want = [(x.detach() + y.detach()) / 2 for x, y in zip(pa, pb)]
        start_round(a, b)
        with torch.no_grad():  # a local step taken while the round ran must survive it
            pa[1].add_(1.0)
        a._finish()
        b._finish()
        assert a.rounds == b.rounds == 1, (a.last_error, b.last_error)
        for x, y, m in zip(pa, pb, want):
            assert torch.allclose(y.detach(), m, atol=tol), (y.detach() - m).abs().max()
        assert torch.allclose(pa[0].detach(), want[0], atol=tol), (pa[0].detach() - want[0]).abs().max()
        assert torch.allclose(pa[1].detach(), want[1] + 1.0, atol=tol)
        assert a.bytes_out == int(2 * (2 - 1) / 2 * (300 * 200 + 50) * (1 if compression == "int8" else 4))
        a.shutdown()
        b.shutdown()


def test_an_averaging_process_that_does_not_start_is_killed_and_forked_again(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """hivemind waits forever for a forked averaging process that got stuck before it was ready
    (seen now and then in peers whose gRPC threads were live at the fork). The first start here
    is made to time out: it is killed, a second process starts and the averager works."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    from peer.dp import group

    real = DecentralizedAverager.run_in_background
    started: list[DecentralizedAverager] = []

    def first_one_hangs(self, await_ready: bool = True, timeout: float | None = None) -> None:
        started.append(self)
        if len(started) == 1:
            self.start()  # a real child, as in the hang; then the wait gives up
            raise TimeoutError
        real(self, await_ready=await_ready, timeout=timeout)

    monkeypatch.setattr(DecentralizedAverager, "run_in_background", first_one_hangs)
    monkeypatch.setattr(group, "START_TIMEOUT_S", 1.0)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        avg = group.GroupAverager(dht, [torch.nn.Parameter(torch.zeros(4))], "test_restart", every=1)
        assert len(started) == 2 and avg.averager is started[1]
        started[0].join(5)
        assert not started[0].is_alive()  # the stuck child is gone
        assert avg.averager.is_alive() and avg.load_state(timeout=2.0) is None  # the new one answers
        assert "did not start within 1s (try 1 of 3)" in caplog.text
        avg.shutdown()
    finally:
        dht.shutdown()


@pytest.mark.parametrize("poison", ["nan", "scaled"])
def test_an_implausible_group_mean_is_refused_and_the_weights_stay(poison: str) -> None:
    """Peer b offers NaN or 100x-scaled parameters: the mean a receives is NaN or far outside a's
    own drift since the last mean, so a keeps its weights and counts the refusal."""
    with two_dhts() as (dht_a, dht_b):
        torch.manual_seed(0)
        init = [torch.randn(100, 50), torch.randn(20)]
        pa = [torch.nn.Parameter(t.clone()) for t in init]
        pb = [torch.nn.Parameter(t.clone()) for t in init]
        a = GroupAverager(dht_a, pa, f"poison_{poison}", every=1, timeout=30.0, compression="none")
        b = GroupAverager(dht_b, pb, f"poison_{poison}", every=1, timeout=30.0, compression="none")
        with torch.no_grad():
            for p in pa:
                p.add_(0.01 * torch.randn_like(p))  # honest local training
            for p in pb:
                p.copy_(torch.full_like(p, float("nan")) if poison == "nan" else 100.0 * p)
        before = [p.detach().clone() for p in pa]
        start_round(a, b)
        a._finish()
        assert a.rejected == 1 and a.rounds == 0, (a.last_error, a.last_rejection)
        if poison == "nan":  # its claim shows it: b is named
            assert "sent NaN or Inf" in a.last_rejection and [x.split(": ")[0] for x in a.suspects] == [str(b.averager.peer_id)]
        else:  # in a pair, size alone names nobody (an honest member with an older base looks the same)
            assert "more than 4.0x this peer's own drift" in a.last_rejection and not a.suspects
        assert all(torch.equal(x.detach(), y) for x, y in zip(pa, before))  # untouched
        assert all(torch.equal(base, t) for base, t in zip(a._base, init))  # the next delta still counts from the last good mean
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("attack", ["flipped", "lying"])
def test_a_sign_flipped_update_is_refused_and_its_sender_named(attack: str) -> None:
    """The peers train the same way (their updates share a direction, as on one distribution).
    `flipped`: in a group of three, c sends the mirror image of its update, of normal size, and
    says so in its claim: a refuses the round and names c. `lying` (a pair): b claims its honest
    values but sends flipped ones: the mean does not match the claims, a refuses the round and
    cannot name anyone."""
    import hivemind

    with two_dhts() as (dht_a, dht_b):
        dht_c = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[str(m) for m in dht_a.get_visible_maddrs()]) if attack == "flipped" else None
        try:
            torch.manual_seed(0)
            init = [torch.randn(100, 50), torch.randn(20)]
            common = [0.01 * torch.randn_like(t) for t in init]
            dhts = [dht_a, dht_b] + ([dht_c] if dht_c else [])
            params = [[torch.nn.Parameter(t.clone()) for t in init] for _ in dhts]
            avgs = [GroupAverager(d, ps, f"flip_{attack}", every=1, timeout=30.0, compression="int8", peer_id=f"peer-{i}") for i, (d, ps) in enumerate(zip(dhts, params))]
            with torch.no_grad():
                for i, ps in enumerate(params):
                    for p, c, t in zip(ps, common, init):
                        update = c + 0.005 * torch.randn_like(p)
                        p.copy_(t - update if attack == "flipped" and i == 2 else t + update)
            a, bad = avgs[0], avgs[-1]
            before = [p.detach().clone() for p in params[0]]
            for avg in avgs:
                avg.after_step(1)
            if attack == "lying":  # after its claim, before the all-reduce (matchmaking takes >= 2 s)
                with torch.no_grad(), bad.averager.get_tensors() as tensors:
                    for t in tensors:
                        t.mul_(-1)
            deadline = time.monotonic() + 60
            while not all(avg._pending.done() for avg in avgs):
                assert time.monotonic() < deadline, "no averaging round within 60 s"
                time.sleep(0.1)
            a._finish()
            assert a.rejected == 1 and a.rounds == 0, (a.last_error, a.last_rejection)
            if attack == "flipped":
                assert "points against the rest of the group" in a.last_rejection
                assert [x.split(":")[0] for x in a.suspects] == [str(bad.averager.peer_id)]
            else:
                assert "a member sent other values than it claimed" in a.last_rejection and not a.suspects
            assert all(torch.equal(x.detach(), y) for x, y in zip(params[0], before))
            for avg in avgs:
                avg.shutdown()
        finally:
            if dht_c is not None:
                dht_c.shutdown()


def test_a_peer_alone_in_its_stage_offers_no_round() -> None:
    import hivemind

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        avg = GroupAverager(dht, [torch.nn.Parameter(torch.zeros(4))], "test_alone", every=1)
        avg.after_step(1, alone=True)
        assert avg._pending is None  # no matchmaking for a group that cannot form
        avg.after_step(2, alone=False)
        assert avg._pending is not None
        avg.shutdown()
    finally:
        dht.shutdown()


def test_a_round_pending_far_past_its_timeout_is_cancelled_and_the_next_offered() -> None:
    import hivemind
    from concurrent.futures import Future

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        avg = GroupAverager(dht, [torch.nn.Parameter(torch.zeros(4))], "test_stuck", every=1, timeout=5.0)
        stuck = Future()  # never resolves, like the hivemind round seen pending for minutes
        avg._pending, avg._offered_wall = stuck, time.monotonic() - 100.0
        avg.after_step(1)
        assert stuck.cancelled() and avg.failures == 1 and "cancelled" in avg.last_error
        assert avg._pending is not None and avg._pending is not stuck  # a new round was offered
        avg.shutdown()
    finally:
        dht.shutdown()


def test_a_big_stage_round_is_given_its_transfer_time_before_it_counts_as_stuck() -> None:
    from types import SimpleNamespace

    tiny = SimpleNamespace(timeout=30.0, numel=400_000, compression="none")
    big = SimpleNamespace(timeout=30.0, numel=750_000_000, compression="none")  # a 1.5B model's stage, fp32
    assert 90 < GroupAverager.stuck_after_s(tiny) < 92  # the tiny run: 3 timeouts, as before
    assert GroupAverager.stuck_after_s(big) == pytest.approx(90 + 750e6 * 4 / 1.25e6)  # 3 GB at 10 Mbit/s: 40 min
