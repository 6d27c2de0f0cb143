"""A peer's startup phases (peer/daemon/startup.py): what each took, and what a joiner says it waits on."""

from __future__ import annotations

import pytest

from peer.daemon.startup import DOING, StartupClock


def test_phases_add_up_to_the_first_step_and_stop_there() -> None:
    now = [3.5]  # the process's age when the daemon's code starts: the imports
    clock = StartupClock(lambda: now[0])
    for phase, t in (("dht", 5.0), ("join", 6.0), ("stage", 6.5), ("first_step", 8.0)):
        clock.begin(phase)
        now[0] = t
    assert clock.phases() == [("imports", 3.5), ("dht", 1.5), ("join", 1.0), ("stage", 0.5), ("first_step", 1.5)]
    assert clock.done() == 8.0
    now[0] = 50.0
    clock.begin("state")  # after the first step nothing moves
    assert clock.done() == 8.0 and sum(s for _, s in clock.phases()) == 8.0


def test_a_phase_entered_twice_is_one_entry_and_the_current_one_counts_to_now() -> None:
    now = [1.0]
    clock = StartupClock(lambda: now[0])
    clock.begin("join")
    now[0] = 3.0
    clock.begin("dht")
    now[0] = 4.0
    clock.begin("join")  # a join retried after the DHT came back
    now[0] = 10.0
    assert clock.phases() == [("imports", 1.0), ("join", 8.0), ("dht", 1.0)]
    assert clock.waiting() == f"{DOING['join']} (6 s; 10 s since start)"


def test_an_unknown_phase_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown startup phase 'warmup': one of imports, tracker, dht"):
        StartupClock(lambda: 0.0).begin("warmup")


def test_after_a_move_s_exec_the_clock_counts_from_the_exec(monkeypatch) -> None:
    """A MOVE execs the same process (same start time in /proc): without the exec's time the new
    life's startup would include the whole old one."""
    import time

    from peer.daemon.startup import STARTED_ENV, process_age_s

    monkeypatch.delenv(STARTED_ENV, raising=False)
    assert process_age_s() > 0  # the process's own age, from /proc
    monkeypatch.setenv(STARTED_ENV, repr(time.time() - 5.0))
    assert 5.0 <= process_age_s() < 6.0
