"""The audit of an averaging round at coordinates nobody knew in advance (peer/dp/audit.py,
peer/dp/commitment.py): a Merkle commitment proves exactly the committed leaves, reveals are
bounded, auditors draw their leaves privately, and on real hivemind rounds a member that sends
honest values at the once-public sample and poison elsewhere, or that will not reveal, has its
round refused."""

from __future__ import annotations

import pytest
import torch
from test_group_averager import FakeClock, offer, two_dhts, wait_rounds

from peer.dp import audit
from peer.dp.commitment import LEAF, commit, leaf_count, verify
from peer.dp.group import GroupAverager
from peer.wire import audit_pb2 as pb


@pytest.mark.parametrize("n", [1, LEAF, LEAF + 1, 5 * LEAF - 3, 9 * LEAF])
def test_a_commitment_proves_its_leaves_and_nothing_else(n: int) -> None:
    torch.manual_seed(n)
    tensors = [torch.randn(n // 2), torch.randn(n - n // 2)]
    c = commit(tensors)
    assert torch.equal(c.values, torch.cat([t.reshape(-1) for t in tensors]))
    count = leaf_count(n)
    leaves = sorted({0, count - 1, count // 2})
    values, proof = c.reveal(leaves)
    assert verify(c.root, n, leaves, values, proof) == ""
    flat = torch.frombuffer(bytearray(values), dtype=torch.float32)
    torch.testing.assert_close(flat, c.values[audit.coordinates(n, leaves)], rtol=0, atol=0)
    changed = bytearray(values)
    changed[-1] ^= 0x01  # one bit of the last value
    assert "does not match the committed root" in verify(c.root, n, leaves, bytes(changed), proof)
    assert "does not match" in verify(
        commit([t + 1e-3 for t in tensors]).root, n, leaves, values, proof
    )  # another vector's root
    assert "outside the" in verify(c.root, n, [count], values, proof)
    assert "bytes of values" in verify(c.root, n, leaves, values[:-4], proof)
    if count > 1:
        bad = bytearray(proof)
        bad[0] ^= 0x80
        assert "does not match" in verify(c.root, n, leaves, values, bytes(bad))
        other = [leaf for leaf in range(count) if leaf not in leaves][:1] or [leaves[0]]
        swapped = [other[0]] + leaves[1:]  # the values of one leaf passed off as another's
        if swapped != leaves and c.values.numel() >= count * LEAF:
            assert "does not match" in verify(c.root, n, swapped, values, proof)


def test_reveals_are_bounded_and_only_for_a_known_commitment() -> None:
    c = commit([torch.randn(3 * LEAF)])
    commitments = {c.root: c}
    assert audit.answer(commitments, pb.RevealRequest(root=b"\0" * 32, leaves=[0])).error.startswith(
        "no commitment with this root"
    )
    assert "1 to 16 leaves" in audit.answer(commitments, pb.RevealRequest(root=c.root, leaves=list(range(17)))).error
    assert "1 to 16 leaves" in audit.answer(commitments, pb.RevealRequest(root=c.root)).error
    assert "outside the 3 leaves" in audit.answer(commitments, pb.RevealRequest(root=c.root, leaves=[3])).error
    reply = audit.answer(commitments, pb.RevealRequest(root=c.root, leaves=[2, 0]))
    assert not reply.error and verify(c.root, c.values.numel(), [2, 0], reply.values, reply.proof) == ""


def test_auditors_draw_their_leaves_privately_and_differently_each_round() -> None:
    n = 10_000 * LEAF
    draws = [audit.pick_leaves(n) for _ in range(20)]
    assert all(len(d) == audit.AUDIT_LEAVES == len(set(d)) and all(0 <= x < leaf_count(n) for x in d) for d in draws)
    assert len({tuple(d) for d in draws}) == 20  # 4 of 10,000 leaves: a repeat is a 1e-13 event
    assert audit.pick_leaves(LEAF * 2) == [0, 1]  # a small stage: every leaf


def test_an_audit_names_a_member_whose_reveal_does_not_prove_out() -> None:
    """run_audit against fake members: one reveals the truth, one reveals other values than it
    committed to, one does not answer, one commits to another size: only the first counts."""
    import asyncio

    torch.manual_seed(0)
    mine = commit([torch.randn(4 * LEAF)])
    honest, liar, silent = (commit([torch.randn(4 * LEAF)]) for _ in range(3))
    gathered = {
        name: {"root": c.root, "n": 4 * LEAF} for name, c in (("me", mine), ("h", honest), ("l", liar), ("s", silent))
    }
    gathered["w"] = {"root": honest.root, "n": 4 * LEAF + 1}

    async def ask(pid, request):
        if pid == "s":
            raise TimeoutError("no answer")
        if pid == "l":  # reveals values that are not the committed ones
            fake = commit([liar.values + 1.0])
            values, _ = fake.reveal(list(request.leaves))
            return pb.RevealReply(values=values, proof=liar.reveal(list(request.leaves))[1])
        return audit.answer({honest.root: honest}, request)

    got = asyncio.run(audit.run_audit("me", mine, gathered, ask))
    assert set(got.values) == {"me", "h"} and set(got.failed) == {"l", "s", "w"}
    assert (
        "is not what it committed to" in got.failed["l"]
        and "did not reveal" in got.failed["s"]
        and f"committed to {4 * LEAF + 1} values" in got.failed["w"]
    )
    index = got.coordinates()
    torch.testing.assert_close(got.tensors()["h"], honest.values[index], rtol=0, atol=0)
    torch.testing.assert_close(got.tensors()["me"], mine.values[index], rtol=0, atol=0)


def cheat_after_commit(monkeypatch: pytest.MonkeyPatch, cheat) -> None:
    """peer-1 runs `cheat` on the tensors it is about to send, right after it committed to them
    (in its forked averaging process, which inherits this patch)."""
    honest_commit = audit.commit_claim

    def commit_then_cheat(tensors, claim, sign):
        out = honest_commit(tensors, claim, sign)
        if claim.get("peer") == "peer-1":
            cheat(tensors)
        return out

    monkeypatch.setattr(audit, "commit_claim", commit_then_cheat)


@pytest.mark.processes
@pytest.mark.parametrize("cheat", ["poison_off_the_public_sample", "refuse_to_reveal"])
def test_a_member_that_sends_other_values_than_it_committed_to_or_will_not_prove_them_is_refused(
    cheat: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack the public sample allowed: b sends its honest values at the 1,024 coordinates
    once seeded from the group key and its update flipped everywhere else (no larger than an
    honest one, so the drift bound passes it). Now b commits to its honest values, a audits
    leaves b could not know: the mean does not match b's proven values and a refuses the round. `refuse_to_reveal`: b sends honestly but answers no audit: a cannot
    check the round, refuses it and names b."""
    torch.manual_seed(0)
    init = [torch.randn(120, 100), torch.randn(40)]
    sizes = [t.numel() for t in init]
    public = torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(1))[
        :1024
    ]  # what an attacker knew before
    keep = torch.zeros(sum(sizes), dtype=torch.bool)
    keep[public] = True

    def poison(tensors):
        for t, k in zip(tensors, keep.split(sizes)):
            t.view(-1).copy_(torch.where(k, t.view(-1), -t.view(-1)))  # int8 rounds send deltas

    if cheat == "poison_off_the_public_sample":
        cheat_after_commit(monkeypatch, poison)
    else:  # both averaging processes inherit it; a's check uses its own values, not a reveal
        monkeypatch.setattr(audit, "answer", lambda commitments, request: pb.RevealReply(error="b reveals nothing"))
    with two_dhts() as (dht_a, dht_b):
        params = [[torch.nn.Parameter(t.clone()) for t in init] for _ in range(2)]
        clock = FakeClock()
        avgs = [
            GroupAverager(
                d, ps, f"audit_{cheat}", every=1, timeout=30.0, compression="int8", peer_id=f"peer-{i}", clock=clock
            )
            for i, (d, ps) in enumerate(zip((dht_a, dht_b), params))
        ]
        try:
            with torch.no_grad():
                for ps in params:
                    for p in ps:
                        p.add_(0.01 * torch.randn_like(p))
            before = [p.detach().clone() for p in params[0]]
            offer(avgs, clock)
            wait_rounds(avgs)
            a, b = avgs
            a._finish()
            assert a.rounds == 0 and a.rejected == 1, (a.last_error, a.last_rejection)
            if cheat == "poison_off_the_public_sample":
                assert "a member sent other values than it committed to" in a.last_rejection
            else:
                assert (
                    "did not prove what it sent: it refused to reveal its committed values: b reveals nothing"
                    in a.last_rejection
                )
                assert [x.split(":")[0] for x in a.suspects] == [str(b.averager.peer_id)]
            assert all(torch.equal(p.detach(), x) for p, x in zip(params[0], before))  # the weights stay
        finally:
            for avg in avgs:
                avg.shutdown()
