"""Attacks the averaging checks once passed (issue 16): a pair member drifting the weights in one
direction under the old 0.1 % floor of the drift bound, and two colluders of three flipping
their updates (a majority the trimmed mean cannot outvote). The rule is `claims.implausible`;
the colluders run on real hivemind rounds."""

from __future__ import annotations

import torch
from test_group_averager import offer, three_members, wait_rounds

from peer.dp.claims import DRIFT_FLOOR, implausible


def test_a_pair_member_riding_the_old_floor_moves_the_weights_nowhere_in_50_rounds() -> None:
    """Honest drift of 1e-4 of the weights' norm per round; the other member adds 9e-4 along one
    fixed direction (under the old floor of 1e-3). With a pair's plain mean every round used to
    pass, moving the weights ~2 % along that direction in 50 rounds; now every such round is
    refused and the weights move only by the honest peer's own steps."""
    torch.manual_seed(0)
    w = torch.randn(20_000)
    scale = float(w.norm())
    direction = torch.randn_like(w)
    direction /= direction.norm()
    base, refused = w.clone(), 0
    old_rule_would_pass = 0
    for _ in range(50):
        honest = torch.randn_like(w)
        offered = base + 1e-4 * scale * honest / honest.norm()
        other = torch.randn_like(w)
        theirs = base + 1e-4 * scale * other / other.norm() + 9e-4 * scale * direction
        mean = (offered + theirs) / 2
        correction, drift = float((mean - offered).norm()), float((offered - base).norm())
        old_rule_would_pass += correction <= 4.0 * drift + 1e-3 * scale
        if implausible([mean], [offered], [base]):
            refused += 1
            base = offered  # it trains on alone (in the swarm its base stays and the delta grows; the same here)
        else:
            base = mean
    assert old_rule_would_pass == 50  # the attack as it was: every round taken
    assert refused == 50
    assert abs(float((base - w) @ direction)) < 1e-4 * scale  # nothing of the attacker's direction got in


def test_the_drift_bound_and_the_direction_rule_pass_honest_rounds() -> None:
    """Honest members with different step counts (their drifts 1x to 5x each other, same
    direction plus noise), plain and trimmed means: no round refused."""
    torch.manual_seed(1)
    w = torch.randn(50_000)
    g = torch.randn_like(w) * 1e-3
    for steps_other in (1, 2, 5):
        base = w.clone()
        offered = base + g + 3e-4 * torch.randn_like(w)
        others = [base + steps_other * g + 3e-4 * steps_other**0.5 * torch.randn_like(w) for _ in range(2)]
        for mean in ((offered + others[0]) / 2, torch.stack([offered, *others]).median(0).values):
            assert implausible([mean], [offered], [base]) == ""


def test_a_group_update_against_this_peer_s_own_is_refused_and_a_tiny_one_is_not_judged() -> None:
    w = torch.randn(1000)
    own = 1e-2 * torch.randn_like(w)
    assert "points against this peer's own" in implausible([w - 0.9 * own], [w + own], [w])
    # below the rounding floor there is no direction to judge (a peer that hardly moved)
    tiny = 0.1 * DRIFT_FLOOR * float(w.norm()) * own / own.norm()
    assert implausible([w - tiny], [w + tiny], [w]) == ""


def test_two_colluders_of_three_flipping_their_updates_get_no_round_from_the_honest_member() -> None:
    """b and c send (and commit to) the mirror image of their updates, of normal size: the trimmed
    mean of three is then theirs, and the checks per member name nobody (each colluder's update
    agrees with the other's). The honest member a sees the group's update point against its own
    and refuses the round; its weights stay."""
    with three_members("collude", "int8") as (init, common, params, avgs, clock):
        with torch.no_grad():
            for i, ps in enumerate(params):
                for p, c, t in zip(ps, common, init):
                    update = c + 0.003 * torch.randn_like(p)
                    p.copy_(t + update if i == 0 else t - update)
        before = [p.detach().clone() for p in params[0]]
        offer(avgs, clock)
        wait_rounds(avgs)
        a = avgs[0]
        a._finish()
        assert a.rounds == 0 and a.rejected == 1, (a.last_error, a.last_rejection)
        assert "points against this peer's own" in a.last_rejection and not a.suspects
        assert all(torch.equal(p.detach(), x) for p, x in zip(params[0], before))
