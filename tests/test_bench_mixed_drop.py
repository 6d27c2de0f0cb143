"""`bench mixed --drop`'s arithmetic: the settled pace and the seconds to reach it, from the
status lines' token counts (the run itself needs the namespace bed: `bench mixed --drop`)."""

from __future__ import annotations

import pytest

from peer.bench.mixed_drop import recovery, tokens_at


def series(*spans: tuple[float, float], start: float = 100.0) -> list[tuple[float, int]]:
    """Status samples a second apart through spans of (seconds, tokens/s)."""
    out, t, n = [(start, 0)], start, 0.0
    for seconds, rate in spans:
        for _ in range(int(seconds)):
            t, n = t + 1, n + rate
            out.append((t, int(n)))
    return out


def test_a_swarm_that_dips_then_settles_recovers_at_its_first_window_near_the_settled_pace() -> None:
    s = series((20, 10_000), (8, 2_000), (62, 7_000))
    got = recovery(s, t_drop=120.0)
    assert got["before_tokens_per_s"] == pytest.approx(10_000)
    assert got["settled_tokens_per_s"] == pytest.approx(7_000)
    assert got["settled_vs_before"] == pytest.approx(0.7)
    # windows [u, u + 10] from the cut: the one at 7 s mixes one second at 2k (6,500 >= 6,300),
    # the one at 6 s two (6,000): recovered at 7 + 10 s
    assert got["recovery_s"] == 17
    assert got["lowest_window_tokens_per_s"] == pytest.approx(2_000 * 0.8 + 7_000 * 0.2)
    assert got["windows_tokens_per_s"][:3] == [3_000, 7_000, 7_000]


def test_a_swarm_that_never_dips_recovers_within_its_first_window() -> None:
    got = recovery(series((20, 9_000), (60, 9_000)), t_drop=120.0)
    assert got["recovery_s"] == 10 and got["settled_vs_before"] == pytest.approx(1.0)


def test_a_run_too_short_after_the_cut_is_refused_and_tokens_interpolate_between_lines() -> None:
    with pytest.raises(ValueError, match="after the cut"):
        recovery(series((20, 9_000), (30, 9_000)), t_drop=120.0)
    s = [(10.0, 0), (12.0, 200)]
    assert tokens_at(s, 11.0) == 100 and tokens_at(s, 5.0) == 0 and tokens_at(s, 20.0) == 200
