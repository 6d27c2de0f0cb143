"""Attacks the averaging checks once passed: a pair member drifting the weights in one direction
under the old 0.1 % floor of the drift bound, and two colluders of three flipping or turning
their updates (a majority the trimmed mean cannot outvote), while honest members whose drifts
differ 1x to 5x still average. The rules are `claims.implausible` and `claims.attribute`; the
colluders run on real hivemind rounds."""

from __future__ import annotations

import pytest
import torch
from test_group_averager import offer, three_members, wait_rounds

from peer.dp.claims import DRIFT_FLOOR, implausible
from peer.dp.steering import MEMBER_COSINE


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
    assert "points away from this peer's own" in implausible([w - 0.9 * own], [w + own], [w])
    # below the rounding floor there is no direction to judge (a peer that hardly moved)
    tiny = 0.1 * DRIFT_FLOOR * float(w.norm()) * own / own.norm()
    assert implausible([w - tiny], [w + tiny], [w]) == ""


@pytest.mark.processes
def test_two_colluders_of_three_flipping_their_updates_get_no_round_from_the_honest_member() -> None:
    """b and c send (and commit to) the mirror image of their updates, of normal size: the trimmed
    mean of three is then theirs, and the checks against the rest of the group name nobody (each
    colluder's update agrees with the other's). The honest member a sees each of them point
    against its own update, names both and refuses the round; its weights stay."""
    with three_members("collude", "int8") as (init, common, params, avgs, clock):
        with torch.no_grad():
            for i, ps in enumerate(params):
                for p, c, t in zip(ps, common, init):
                    update = c + 0.003 * torch.randn_like(p)
                    p.copy_(t + update if i == 0 else t - update)
        before, a = [p.detach().clone() for p in params[0]], refused_round(avgs, clock)
        assert "far from this peer's own" in a.last_rejection
        assert {x.split(":")[0] for x in a.suspects} == {str(x.averager.peer_id) for x in avgs[1:]}
        assert all(torch.equal(p.detach(), x) for p, x in zip(params[0], before))


def refused_round(avgs, clock):
    """Offer one round to all three and wait for it; the first member must have refused it."""
    offer(avgs, clock)
    wait_rounds(avgs)
    a = avgs[0]
    a._finish()
    assert a.rounds == 0 and a.rejected == 1, (a.last_error, a.last_rejection)
    return a


def turned(u: list[torch.Tensor], cos: float, seed: int) -> list[torch.Tensor]:
    """An update of the size of `u` at cosine `cos` to it (the rest along a random direction)."""
    flat = torch.cat([t.reshape(-1) for t in u])
    w = torch.randn(flat.shape, generator=torch.Generator().manual_seed(seed))
    w -= (w @ flat) / (flat @ flat) * flat
    v = flat.norm() * (cos * flat / flat.norm() + (1 - cos**2) ** 0.5 * w / w.norm())
    return [x.view_as(t) for x, t in zip(v.split([t.numel() for t in u]), u)]


@pytest.mark.processes
@pytest.mark.parametrize("cos", [-0.45, 0.0])
def test_two_colluders_of_three_turning_their_updates_do_not_steer_the_honest_member(cos: float) -> None:
    """b and c both send (and commit to) the same update of honest size at cosine -0.45 or 0 to
    a's: every coordinate's trimmed mean is theirs. These rounds were taken at full size (only a
    flip was refused). Now a refuses the round: at -0.45 it names both colluders (each points
    away from its own update at the audited coordinates), at 0 the group's update points away
    from its own; a's weights stay, so its applied update is its own."""
    with three_members(f"turn{int(-100 * cos)}", "int8") as (init, common, params, avgs, clock):
        torch.manual_seed(1)
        honest = [c + 0.003 * torch.randn_like(c) for c in common]
        theirs = turned(honest, cos, seed=2)
        with torch.no_grad():
            for i, ps in enumerate(params):
                for p, t, u, v in zip(ps, init, honest, theirs):
                    p.copy_(t + (u if i == 0 else v))
        before, a = [p.detach().clone() for p in params[0]], refused_round(avgs, clock)
        if cos < MEMBER_COSINE:
            assert "far from this peer's own" in a.last_rejection
            assert {x.split(":")[0] for x in a.suspects} == {str(x.averager.peer_id) for x in avgs[1:]}
        else:
            assert "the group's update points away from this peer's own" in a.last_rejection
        assert all(torch.equal(p.detach(), x) for p, x in zip(params[0], before))


@pytest.mark.processes
def test_honest_members_whose_drifts_differ_1x_to_5x_all_average() -> None:
    """Members that took 1, 3 and 5 times the steps (update = k x the common direction plus
    noise growing as sqrt(k)), noisy enough that two of them agree only at cosine ~0.1 (what the
    tiny model's members show after 20 rounds): every member takes the round."""
    with three_members("honest135", "int8") as (init, common, params, avgs, clock):
        torch.manual_seed(3)
        with torch.no_grad():
            for k, ps in zip((1, 3, 5), params):
                for p, t, c in zip(ps, init, common):
                    p.copy_(t + k * c + k**0.5 * 0.04 * torch.randn_like(c))
        offer(avgs, clock)
        wait_rounds(avgs)
        for avg in avgs:
            avg._finish()
        assert [avg.rejected for avg in avgs] == [0, 0, 0], [avg.last_rejection for avg in avgs]
        assert [avg.rounds for avg in avgs] == [1, 1, 1], [avg.last_error for avg in avgs]
