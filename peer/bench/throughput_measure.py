"""One mode of `anchormesh bench throughput` measured on the namespace test bed (peer/bench/throughput.py).

Why a module of its own: starting a fresh bed, waiting out the warm-up and reading the tracker's
and the kernel's counters is the one part that needs network namespaces; the throughput and
mixed benches both call it. What is measured is in the throughput module's docstring.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from peer.bench.bedswarm import BedSwarm, host_of, write_toml
from peer.bench.netbed import NetBed
from peer.bench.throughput_modes import mode_config
from peer.errors import ConfigError


def median(xs: list[float]) -> float:
    """The median of `xs` (the mean of the middle two for an even count); 0 for none."""
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else 0.0


def first_evaluation(s: dict) -> float | None:
    """The loss of the run's first evaluation pass (launched at the first run step >= eval_every)
    as a last-stage peer reported it, or None. Not the status's eval_loss, the newest pass's: a
    pass that went through a slow peer may end after the next one, which then hides it."""
    return next((p["eval_loss"] for p in s["peers"] if p.get("eval_id") == 1 and p.get("eval_loss") is not None), None)


def live_peers(s: dict) -> int:
    return sum(p["state"] in ("active", "idle") for p in s["peers"])


def _rates_text(rates: list[float | None]) -> str:
    speeds = sorted({r for r in rates if r is not None})
    if not speeds:
        return "unshaped"
    return " and ".join(f"{r:.2f}" for r in speeds) + " Mbit/s" + (" (mixed)" if len(speeds) > 1 else "")


def warmed(s: dict, up: dict, warmup: int, n: int) -> bool:
    """Every one of the `n` peers live and `warmup` steps of its own past where it was in `up`
    (every peer live): the run's step alone is the fastest stage-0 peer's, and a window opened
    on it would measure a slow peer's start (its codec's warm-up format, its first coder), not
    the run it settles into."""
    if live_peers(s) != n or s["step"] < up["step"] + warmup:
        return False
    before = {p["id"]: p.get("step") or 0 for p in up["peers"]}
    return all(
        (p.get("step") or 0) >= before.get(p["id"], 0) + warmup for p in s["peers"] if p["state"] in ("active", "idle")
    )


def measure_mode(
    mode: str,
    rates: list[float | None],
    stages: int,
    replicas: int,
    warmup: int,
    steps: int,
    dp_every: int,
    workdir: Path,
    subnet: int,
    timeout_s: float,
    config: dict | None = None,
    reshape: Callable[[NetBed, dict], None] | None = None,
) -> dict:
    """Run one mode in a fresh bed (host i's link at rates[i] Mbit/s, None = unshaped; host 0 is
    the bootstrap's) and measure it (see the module docstring). `config`: run.toml content
    instead of `mode_config(mode, ...)`. `reshape(bed, status)`: called once every peer is live
    (with their stages known) to set links; the warm-up then counts from there, `warmup` steps
    of every peer's own (`warmed`), and the window is the next `steps - warmup` run steps (to
    step `steps` at least, where the compared evaluation runs)."""
    cfg_path = workdir / f"{mode}.toml"
    write_toml(config or mode_config(mode, stages, steps, dp_every), cfg_path)
    n = stages * replicas
    if len(rates) != 1 + n:
        raise ConfigError("rates", len(rates), f"must name 1 + {n} hosts (the bootstrap and {n} peers)")
    print(
        f"[{mode}] {n} peers + bootstrap, links {_rates_text(rates)}; warm-up: every peer {warmup} steps, "
        f"then {steps - warmup} run steps measured",
        flush=True,
    )
    t_start = time.monotonic()
    with NetBed(rates, subnet=subnet) as bed:
        swarm = BedSwarm(bed, cfg_path, workdir / mode)
        evaluated: list[dict] = []  # the first report of the evaluation launched at step `steps`

        def seen(s: dict) -> dict:
            if not evaluated and (got := first_evaluation(s)) is not None:
                evaluated.append({"eval_loss": got, "eval_step": steps})  # eval_every = steps: its first pass
            return s

        up = swarm.wait_status(lambda s: live_peers(seen(s)) == n, timeout_s, f"{n} live peers")
        if reshape is not None:
            reshape(bed, up)
        s0 = swarm.wait_status(
            lambda s: warmed(seen(s), up, warmup, n),
            timeout_s,
            f"{n} live peers, each {warmup} steps past step {up['step']}",
        )
        window = steps - warmup  # run steps measured, from wherever every peer was warm
        c0 = bed.counters()
        last_print = time.monotonic()

        def progress(s: dict) -> bool:
            nonlocal last_print
            seen(s)
            if time.monotonic() - last_print > 15:
                last_print = time.monotonic()
                done = s["step"] - s0["step"]
                rate = done / max(s["uptime_s"] - s0["uptime_s"], 1e-9)
                eta = (s0["step"] + window - s["step"]) / rate if rate > 0 else math.inf
                print(
                    f"[{mode}] step {s['step']}/{s0['step'] + window}  {s['tokens_per_s']:,.0f} tok/s  ETA {eta:.0f}s",
                    flush=True,
                )
            return s["step"] >= max(steps, s0["step"] + window)

        s1 = swarm.wait_status(progress, timeout_s, f"step {steps}")
        c1 = bed.counters()
        # the evaluation launched at step `steps`, every mode's at the same tokens (the window may
        # close after it, or a later one may have replaced it by then)
        if not evaluated:
            swarm.wait_status(lambda s: bool(seen(s)) and bool(evaluated), timeout_s, f"the evaluation at step {steps}")
        s2 = evaluated[0]
    tokens = s1["tokens"] - s0["tokens"]
    seconds = s1["uptime_s"] - s0["uptime_s"]
    wire = sum(c1[i][0] - c0[i][0] for i in c1)
    result = {
        "tokens_per_s": tokens / seconds,
        "wire_bytes_per_token": wire / tokens,
        "eval_loss": s2["eval_loss"],
        "eval_step": s2["eval_step"],
        "rate_mbit": rates[1] if len(set(rates[1:])) == 1 else None,
        "tokens_measured": tokens,
        "seconds_measured": seconds,
        "warmup_s": s0["uptime_s"] - up["uptime_s"],  # every peer live (links reshaped) to every peer warm
        "window_steps": [s0["step"], s1["step"]],
        "app_bytes_per_token": {
            "pp": s1["pp_bytes_per_token"],
            "dp": s1["dp_bytes_per_token"],
            "anchor": s1["anchor_bytes_per_token"],
        },
        "pp_compression": s1["pp_compression"],
        "train_loss": s1["loss"],
        "peer_startup_s": median(
            [p["startup_s"] for p in s1["peers"] if p["state"] in ("active", "idle") and p.get("startup_s")]
        ),  # process start to first step
        "peer_startup_phases_s": startup_phases(
            [p.get("startup_phases") for p in s1["peers"] if p["state"] in ("active", "idle")]
        ),  # where it went
        "peer_capacity_tokens_per_s": median(
            [
                p["capacity_tokens_per_s"]
                for p in s1["peers"]
                if p["state"] in ("active", "idle") and p["capacity_tokens_per_s"] > 0
            ]
        ),
        "wall_s": time.monotonic() - t_start,
        "peers": peer_rows(bed, s1),
    }
    print(
        f"[{mode}] {result['tokens_per_s']:,.0f} tok/s, {result['wire_bytes_per_token']:.0f} wire B/token, eval loss {result['eval_loss']:.4f} at step {result['eval_step']} ({result['wall_s']:.0f}s)",
        flush=True,
    )
    return result


def peer_rows(bed: NetBed, status: dict) -> list[dict]:
    """Per live peer of `status`: its stage, its host's shaped rates, and what it measured and sent."""

    def host(p: dict):
        return bed.hosts[i] if (i := host_of(p["id"])) is not None else None

    return [
        {
            "id": p["id"],
            "stage": p["stage"],
            "host_rate_mbit": h.rate_mbit if (h := host(p)) else None,
            "host_dp_rate_mbit": h.dp_rate_mbit if h else None,
            "tokens_per_s": p["tokens_per_s"],
            "link_mbit": p.get("link_mbit"),
            "pp_keep": p.get("pp_keep"),
            "dp_period_s": p.get("dp_period_s"),
            "dp_rounds": p["dp_rounds"],
        }
        for p in status["peers"]
        if p["state"] in ("active", "idle")
    ]


def startup_phases(per_peer: list[dict | None]) -> dict[str, float]:
    """Each startup phase's median seconds over the peers that reported one (a phase a peer
    skipped, e.g. a group state download, counts over the peers that had it)."""
    names = list(dict.fromkeys(name for phases in per_peer if phases for name in phases))
    return {
        name: round(median([phases[name] for phases in per_peer if phases and name in phases]), 2) for name in names
    }
