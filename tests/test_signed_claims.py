"""Signed averaging claims (peer/dp/signed_claims.py): a claim altered on the way (by the round's
leader, who relays everyone's), made under another member's id or for another run, replayed from
an old round, or unsigned is refused; on real hivemind rounds, signed claims pass and an altered
one makes the round refused with the weights untouched."""

from __future__ import annotations

import pytest
import torch
from test_group_averager import FakeClock, start_round, two_dhts

from peer.dp.group import GroupAverager
from peer.dp.signed_claims import ClaimSigner
from peer.security.identity import Identity, certificate_bytes

RUN = "run-s"


def member(tracker: Identity, peer_id: str, run_id: str = RUN) -> ClaimSigner:
    me = Identity.generate()
    return ClaimSigner(me, RUN, tracker.sign(certificate_bytes(run_id, peer_id, me.public)), tracker.public)


def test_only_an_untouched_member_claim_of_this_round_passes() -> None:
    tracker = Identity.generate()
    a, b = member(tracker, "peer-a"), member(tracker, "peer-b")
    claim = a.sign({"peer": "peer-a", "root": b"\x01" * 32, "n": 4096}, "run-s_stage1", "QmA", 1000.0)
    assert b.check(claim, "run-s_stage1", "QmA", 1003.0, 30.0) == ""
    cases = {
        "root": {**claim, "root": b"\x02" + claim["root"][1:]},  # the leader changed the commitment
        "n": {**claim, "n": 4095},
        "peer": {**claim, "peer": "peer-b"},  # passed off as another member
        "time": {**claim, "time": 999.0},
    }
    for field, altered in cases.items():
        assert b.check(altered, "run-s_stage1", "QmA", 1000.0, 30.0), field
    assert "signature does not match" in b.check(
        claim, "run-s_stage1", "QmB", 1000.0, 30.0
    )  # re-keyed under another hivemind id
    assert "signature does not match" in b.check(claim, "run-s_stage0", "QmA", 1000.0, 30.0)  # another stage group
    assert "replayed" in b.check(claim, "run-s_stage1", "QmA", 1100.0, 30.0)
    assert b.check({"peer": "peer-a", "root": b"", "n": 0}, "run-s_stage1", "QmA", 1000.0, 30.0) == "it is unsigned"
    assert b.check({**claim, "n": "4096"}, "run-s_stage1", "QmA", 1000.0, 30.0) == "its fields have the wrong types"
    outsider = member(Identity.generate(), "peer-x")  # certified by another tracker
    forged = outsider.sign({"peer": "peer-x", "root": b"\x00" * 32, "n": 1}, "run-s_stage1", "QmX", 1000.0)
    assert "not issued by this run's tracker" in b.check(forged, "run-s_stage1", "QmX", 1000.0, 30.0)
    other_run = member(tracker, "peer-c", run_id="run-other")
    assert "not issued" in b.check(
        other_run.sign({"peer": "peer-c", "root": b"\x00" * 32, "n": 1}, "p", "QmC", 1000.0), "p", "QmC", 1000.0, 30.0
    )
    why = b.check_group({"QmA": claim, "QmB": cases["root"]}, "run-s_stage1", 1000.0, 30.0)
    assert why.startswith("the claim of peer-a (QmB) is refused")


class Tampering(ClaimSigner):
    """Signs, then changes the committed root: what a relaying leader's change looks like to the
    others (it signs in the averaging process, which is forked with this subclass)."""

    def sign(self, claim: dict, prefix: str, hivemind_id: str, now: float) -> dict:
        out = super().sign(claim, prefix, hivemind_id, now)
        root = bytearray(out["root"])
        root[0] ^= 0x40
        return {**out, "root": bytes(root)}


@pytest.mark.processes
@pytest.mark.parametrize("tamper", [False, True])
def test_a_round_with_an_altered_claim_is_refused_and_an_untouched_one_is_taken(tamper: bool) -> None:
    tracker = Identity.generate()
    with two_dhts() as (dht_a, dht_b):
        torch.manual_seed(0)
        init = [torch.randn(60, 40), torch.randn(10)]
        pa, pb = [torch.nn.Parameter(t.clone()) for t in init], [torch.nn.Parameter(t.clone()) for t in init]
        clock = FakeClock()
        signer_b = member(tracker, "peer-b")
        if tamper:
            signer_b = Tampering(signer_b.identity, RUN, signer_b.certificate, signer_b.tracker_key)
        a = GroupAverager(
            dht_a,
            pa,
            "signed",
            every=1,
            timeout=8.0,
            compression="none",
            peer_id="peer-a",
            clock=clock,
            signer=member(tracker, "peer-a"),
        )
        b = GroupAverager(
            dht_b,
            pb,
            "signed",
            every=1,
            timeout=8.0,
            compression="none",
            peer_id="peer-b",
            clock=clock,
            signer=signer_b,
        )
        try:
            with torch.no_grad():  # different local training since the common start
                for p in pa + pb:
                    p.add_(0.01 * torch.randn_like(p))
            before_a = [p.detach().clone() for p in pa]
            start_round(a, b, clock)
            a._finish()
            b._finish()
            if tamper:
                assert a.rounds == 0 and a.rejected == 1 and "signature does not match" in a.last_rejection, (
                    a.rounds,
                    a.last_rejection,
                    a.last_error,
                )
                assert all(torch.equal(p.detach(), x) for p, x in zip(pa, before_a))  # the weights stay
            else:
                assert a.rounds == b.rounds == 1 and a.rejected == b.rejected == 0, (
                    a.last_error,
                    a.last_rejection,
                    b.last_rejection,
                )
        finally:
            a.shutdown()
            b.shutdown()
