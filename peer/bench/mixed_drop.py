"""`anchormesh bench mixed --drop`: one peer's link falls to a tenth of its rate mid-run; how long
the swarm takes to settle at its new pace.

The swarm runs self-tuning (the adaptive mode of `bench mixed`) with every link at the fast rate.
Once every peer has warmed up it runs `before_s` seconds, then the second peer of the last stage
has its link cut to fast / `factor` (both ways, as `bench mixed` slows its hosts), and the run
goes on for `after_s` seconds. From the tracker's token count (one status line a second):

    settled    tokens/s over the last `settle_s` seconds: the pace the swarm found with the slow link
    recovery   seconds from the cut to the end of the first `smooth_s` window (windows start
               every second from the cut) whose tokens/s is within `within` of the settled pace
    windows    tokens/s of consecutive `smooth_s` windows from the cut, to read the dip by eye

Windows of 10 s: the token count moves a step (1,024 tokens) at a time and a 5 s window of the
bed's swarm swings by a third with no change of link.

The settled pace stands for the swarm's new compute-bound: no other run is made with that link
slow from the start (the adaptive mode of `bench mixed` is that run for two slowed peers).
"""

from __future__ import annotations

import time
from pathlib import Path

from peer.bench.bedswarm import BedSwarm, write_toml
from peer.bench.dp_shape import swarm_groups
from peer.bench.netbed import NetBed
from peer.bench.throughput_measure import live_peers, peer_rows, warmed


def tokens_at(series: list[tuple[float, int]], t: float) -> float:
    """The token count at uptime `t`, linear between status lines (clamped at the ends)."""
    if t <= series[0][0]:
        return float(series[0][1])
    for (t0, n0), (t1, n1) in zip(series, series[1:]):
        if t <= t1:
            return n0 + (n1 - n0) * (t - t0) / (t1 - t0) if t1 > t0 else float(n1)
    return float(series[-1][1])


def recovery(
    series: list[tuple[float, int]], t_drop: float, smooth_s: float = 10.0, settle_s: float = 30.0, within: float = 0.1
) -> dict:
    """Before, settled and recovery (module docstring) from (uptime, tokens) status samples."""

    def rate(a: float, b: float) -> float:
        return (tokens_at(series, b) - tokens_at(series, a)) / (b - a)

    end = series[-1][0]
    if end - t_drop < settle_s + smooth_s:
        raise ValueError(f"{end - t_drop:.0f} s after the cut: need more than settle_s + smooth_s")
    settled = rate(end - settle_s, end)
    starts = [t_drop + k for k in range(int(end - smooth_s - t_drop) + 1)]
    first = next((u for u in starts if rate(u, u + smooth_s) >= (1 - within) * settled), None)
    return {
        "before_tokens_per_s": rate(series[0][0], t_drop),
        "settled_tokens_per_s": settled,
        "settled_vs_before": settled / max(rate(series[0][0], t_drop), 1e-9),
        "recovery_s": None if first is None else first + smooth_s - t_drop,
        "lowest_window_tokens_per_s": min(rate(u, u + smooth_s) for u in starts),
        "windows_tokens_per_s": [
            round(rate(u, u + smooth_s)) for u in starts[:: int(smooth_s)]
        ],  # consecutive windows from the cut
    }


def run_drop(
    fast: float,
    stages: int,
    replicas: int,
    config: dict,
    workdir: Path,
    subnet: int,
    warmup: int = 10,
    factor: float = 10.0,
    before_s: float = 20.0,
    after_s: float = 75.0,
    timeout_s: float = 300.0,
) -> dict:
    """The run the module docstring describes; returns its JSON part."""
    n = stages * replicas
    cfg_path = workdir / "drop.toml"
    write_toml(config, cfg_path)
    print(f"[drop] {n} peers at {fast:.2f} Mbit/s; one cut to {fast / factor:.2f} after {before_s:.0f} s", flush=True)
    t_start = time.monotonic()
    series: list[tuple[float, int]] = []

    def until(t_end: float):
        def cond(s: dict) -> bool:
            if not series or s["uptime_s"] > series[-1][0]:
                series.append((s["uptime_s"], s["tokens"]))
            return s["uptime_s"] >= t_end

        return cond

    with NetBed([fast] * (1 + n), subnet=subnet) as bed:
        swarm = BedSwarm(bed, cfg_path, workdir / "drop")
        up = swarm.wait_status(lambda s: live_peers(s) == n, timeout_s, f"{n} live peers")
        s0 = swarm.wait_status(lambda s: warmed(s, up, warmup, n), timeout_s, f"every peer {warmup} steps in")
        series.append((s0["uptime_s"], s0["tokens"]))
        cut = swarm.wait_status(until(s0["uptime_s"] + before_s), timeout_s, f"{before_s:.0f} s at full rate")
        host = swarm_groups(cut, stages)[-1][-1]  # the last stage's second peer
        bed.set_rate(host, fast / factor)
        t_drop = cut["uptime_s"]
        print(f"[drop] host {host} cut to {fast / factor:.2f} Mbit/s at uptime {t_drop:.0f} s", flush=True)
        end = swarm.wait_status(until(t_drop + after_s), after_s + timeout_s, f"{after_s:.0f} s after the cut")
        peers = peer_rows(bed, end)
    out = {
        **recovery(series, t_drop),
        "cut_host": host,
        "fast_mbit": fast,
        "cut_mbit": fast / factor,
        "before_s": before_s,
        "after_s": after_s,
        "series": [(round(t - t_drop, 2), n) for t, n in series],  # (seconds from the cut, tokens)
        "peers": peers,
        "wall_s": time.monotonic() - t_start,
    }
    print(
        f"[drop] {out['before_tokens_per_s']:,.0f} tok/s before, settled at {out['settled_tokens_per_s']:,.0f} "
        f"({out['settled_vs_before']:.2f}), recovered in {out['recovery_s']} s",
        flush=True,
    )
    return out
