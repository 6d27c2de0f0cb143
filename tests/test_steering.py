"""Each member's lean over rounds (peer/dp/steering.py): a member that adds a small bias in one
direction every round, below the honest spread (every single round passes every check), is named
within tens of rounds, while honest members whose drifts differ 1x to 5x are never named, whoever
is the slow one. Rounds are simulated as a `GroupAverager` sees them: full updates, a trimmed
mean, and each member's values at 4,096 coordinates drawn afresh each round (the audit)."""

from __future__ import annotations

import pytest
import torch

from peer.dp.claims import implausible
from peer.dp.robust import trimmed_mean
from peer.dp.steering import BIAS_MEMBERS, BiasTracker, away_from_own


def rounds(
    steps: list[int], bias: float, count: int, seed: int = 0, n: int = 60_000
) -> tuple[BiasTracker, int | None, int]:
    """`count` rounds of members taking `steps` local steps each (update: steps x a common
    direction that drifts from round to round, plus noise growing as sqrt(steps)); the last
    member adds `bias` times the observer's per-coordinate spread along a fixed direction.
    Member 0 observes. Returns its tracker, the first round in which someone was named, and
    how many rounds the observer refused (none may be: the bias is below every round's checks)."""
    g = torch.Generator().manual_seed(seed)
    tracker = BiasTracker([torch.zeros(n)])
    if len(steps) >= BIAS_MEMBERS:  # as the group does: the sums exist from a round of three members
        tracker.start()
    direction = torch.randn(n, generator=g)
    direction /= direction.norm()
    common = torch.randn(n, generator=g)
    first, refused = None, 0
    for t in range(count):
        common = 0.7 * common + 0.3 * torch.randn(n, generator=g)
        unit = common / common.norm() * n**0.5
        updates = [k * unit + k**0.5 * 2.0 * torch.randn(n, generator=g) for k in steps]
        updates[-1] += bias * float(updates[0].std()) * n**0.5 * direction
        mean = trimmed_mean(torch.stack(updates))
        refused += implausible([mean], [updates[0]], [torch.zeros(n)]) != ""
        audited = torch.randperm(n, generator=g)[:4096]
        at = {f"m{i}": u[audited] for i, u in enumerate(updates)}
        if any(away_from_own(u, at["m0"], 0.0) for u in at.values()):
            refused += 1
        named = tracker.observe(at, tracker.reference(lambda ts: ts[0][audited]), "m0")
        if named and first is None:
            first = t
        tracker.add([mean], [updates[0]])
    return tracker, first, refused


@pytest.mark.parametrize("steps", [[1, 3, 5], [5, 3, 1], [3, 1, 5], [1, 5, 5], [1, 1, 1]])
def test_honest_members_with_drifts_1x_to_5x_are_never_named(steps: list[int]) -> None:
    tracker, first, refused = rounds(steps, 0.0, 120)
    assert first is None and not tracker.named, {k: round(tracker.z(k), 1) for k in tracker.scores}
    assert refused == 0


def test_a_group_of_two_holds_no_sums_and_names_no_one() -> None:
    """Of two members each one's lean mirrors the other's: neither can exceed the other's by the
    limit, so the tracker holds nothing (four copies of the stage) and names no one, biased or not."""
    tracker, first, _ = rounds([1, 1], 0.3, 30)
    assert not tracker.started and tracker.group_even == [] and first is None and not tracker.named


@pytest.mark.parametrize("steps", [[1, 3, 1], [1, 1, 1], [1, 5, 1, 1]])
def test_a_member_adding_a_small_bias_every_round_is_named(steps: list[int]) -> None:
    """The bias is 0.3 of the observer's per-coordinate spread: no round is refused (the trimmed
    mean and every check pass it), but the tracker names the biased member, and only it. (The
    biased member and the observer move at the group's pace: a member or an observer at another
    pace is not scored, see steering.BIAS_PACE.)"""
    tracker, first, refused = rounds(steps, 0.3, 60)
    assert refused == 0
    assert set(tracker.named) == {f"m{len(steps) - 1}"} and first is not None and first <= 40, (
        first,
        {k: round(tracker.z(k), 1) for k in tracker.scores},
    )


def test_a_member_far_from_this_peer_s_own_update_is_named_and_a_still_one_is_not_judged() -> None:
    own = torch.randn(4096)
    assert away_from_own(-0.45 * own + 0.9 * torch.randn(4096), own, 1e-6).startswith(
        "its update is far from this peer's own"
    )
    assert away_from_own(0.1 * own + torch.randn(4096), own, 1e-6) == ""
    assert away_from_own(-own, torch.zeros(4096), 1e-6) == ""  # this peer did not move: no direction to judge


@pytest.mark.processes
@pytest.mark.parametrize("bias", [0.5, 0.0])
def test_on_real_rounds_a_biased_member_is_named_in_the_status_and_every_round_is_taken(
    bias: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three members on real hivemind rounds; c adds half the honest spread along one fixed
    direction every round. Every round is taken by a (nothing in any one round is wrong), and
    within 8 rounds a names c: in its suspects (the status's `dp_suspects`) and `leaning`.
    Without the bias nobody is named in the 8 rounds. The warm-up is shortened so that the
    test takes a few rounds, not tens."""
    from test_group_averager import offer, three_members, wait_rounds

    from peer.dp import steering

    monkeypatch.setattr(steering, "BIAS_WARMUP", 2)
    monkeypatch.setattr(steering, "BIAS_MIN_ROUNDS", 2)
    with three_members("lean", "int8") as (init, common, params, avgs, clock):
        g = torch.Generator().manual_seed(5)
        direction = [torch.randn(t.shape, generator=g) for t in init]
        size = sum(float((d**2).sum()) for d in direction) ** 0.5
        a, c = avgs[0], avgs[2]
        for step in range(8):
            with torch.no_grad():
                common = [0.7 * x + 0.3 * 0.01 * torch.randn(x.shape, generator=g) for x in common]
                for i, ps in enumerate(params):
                    for p, x, d in zip(ps, common, direction):
                        p.add_(
                            x
                            + 0.01 * torch.randn(x.shape, generator=g)
                            + (bias * 0.01 * d * d.numel() ** 0.5 / size * len(init) ** -0.5 if i == 2 else 0)
                        )
            if step == 0:
                offer(avgs, clock)
            else:
                clock.t += 1.0
                for avg in avgs:
                    avg.after_step(2 + step)
            wait_rounds(avgs)
            for avg in avgs:
                avg._finish()
            if a.leaning:
                break
        assert a.rejected == 0 and a.rounds == step + 1, (a.last_rejection, a.last_error)
        if not bias:
            assert a.leaning == 0 and not a.suspects and step == 7, {k: round(a.bias.z(k), 1) for k in a.bias.scores}
            return
        named = str(c.averager.peer_id)
        assert a.leaning == 1 and [x.split(":")[0] for x in a.suspects] == [named], (
            list(a.suspects),
            {k: round(a.bias.z(k), 1) for k in a.bias.scores},
        )
