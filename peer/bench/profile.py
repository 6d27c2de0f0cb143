"""`anchormesh bench profile`: where the CPU goes in one throughput-bench mode on the test bed.

Why: the throughput targets are missed where something other than the model's compute takes the
time. Two views of the same measured window (a 2-stage x 2-peer swarm in network namespaces,
links shaped as in `bench throughput`):

- **CPU seconds per process kind**, from /proc (so C, Go and idle-looking event loops count as
  what they are): the peers' main processes (model, codec, gRPC, stage loop), hivemind's Python
  children (DHT node, averaging process), hivemind's p2pd (Go libp2p daemon), the bootstrap.
- **Inside the peers' main processes**, when `py-spy` is installed (not a dependency: `pip
  install py-spy`): the share of on-CPU samples per part (model forward/backward, optimizer,
  codec, wire serialization, gRPC, stage loop), by the innermost anchormesh or library frame.
  Samples whose innermost frame is a wait (locks, sleeps, polls) are counted as idle.

Output: JSON on stdout or `--out OUT`.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer.bench.bedswarm import BedSwarm, write_toml
from peer.bench.netbed import NetBed, available
from peer.bench.profile_checks import checks_breakdown, compare, share_of_machine
from peer.bench.profile_samples import samples
from peer.bench.throughput_modes import MODES, mode_config
from peer.errors import ConfigError

HZ = os.sysconf("SC_CLK_TCK")
PARTS = (  # innermost match wins, walking from the leaf up
    ("codec", ("peer/codec/",)),
    ("wire serialization / validation", ("SerializeToString", "ParseFromString", "FromString", "peer/wire/tensors.py")),
    ("optimizer step", ("peer/optim/", "torch/optim")),
    ("model forward/backward", ("peer/model/", "torch/autograd", "torch/nn/")),
    ("gRPC", ("grpc/",)),
    ("hivemind (in the peer process)", ("hivemind/",)),
    ("stage loop (runner, daemon)", ("peer/pipeline/", "peer/daemon/")),
)


def _processes() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds so far, command name)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2 :].split()
        out[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / HZ, st[st.index("(") + 1 : st.rindex(")")])
    return out


def _tree(root: int, procs: dict) -> list[int]:
    kids = collections.defaultdict(list)
    for pid, (parent, _, _) in procs.items():
        kids[parent].append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids[p]
    return out


def _kind(pid: int, root: int, comm: str) -> str:
    if pid == root:
        return "peer main processes"
    return "hivemind p2pd (Go)" if comm.startswith("p2pd") else "hivemind python children (DHT, averager)"


def breakdown(raw_files: list[Path]) -> dict:
    """Shares of on-CPU py-spy samples per part (see PARTS), from py-spy's raw output."""
    parts, idle = collections.Counter(), 0
    for frames, n, waiting in samples(raw_files):
        if waiting:
            idle += n
            continue
        part = next((name for fr in reversed(frames) for name, pats in PARTS if any(p in fr for p in pats)), "other")
        parts[part] += n
    busy = sum(parts.values())
    return {
        "on_cpu_samples": busy,
        "idle_samples": idle,
        "shares": {k: round(v / busy, 3) for k, v in parts.most_common()} if busy else {},
    }


def children_breakdown(raw_files: list[Path], top: int = 8) -> dict:
    """hivemind's Python children, from py-spy's raw output: on-CPU samples of the DHT process and
    of the averaging process (told apart by their stacks), and the innermost frames that take them."""
    kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    idle = collections.Counter()
    for frames, n, waiting in samples(raw_files):
        kind = (
            "averager"
            if any("averaging/" in fr for fr in frames)
            else "dht"
            if any("hivemind/dht" in fr for fr in frames)
            else "other"
        )
        if waiting:
            idle[kind] += n
            continue
        kinds[kind][frames[-1].split(" (")[0] + " (" + frames[-1].rsplit("/", 1)[-1]] += n
    return {
        k: {"on_cpu_samples": sum(c.values()), "idle_samples": idle[k], "top": dict(c.most_common(top))}
        for k, c in sorted(kinds.items())
    }


def run_profile(
    mode: str,
    bandwidth_mbit: float | None,
    dp_every: int = 5,
    seconds: float = 25.0,
    warmup: int = 8,
    dp_min_period_s: float | None = None,
    tls: bool = True,
) -> dict:
    """One profiled window of `mode` on the bed; `tls` False runs every process with
    --insecure-plaintext (the control for what TLS costs, see peer/bench/profile_checks.py)."""
    if mode not in MODES:
        raise ConfigError("--mode", mode, f"must be one of {', '.join(MODES)}")
    why = available()
    if why:
        raise ConfigError("bench profile", "network namespaces", why)
    work = Path(tempfile.mkdtemp(prefix="anchormesh-profile-"))
    cfg = work / "run.toml"
    run = mode_config(mode, 2, 10**9, dp_every)
    if dp_min_period_s is not None:
        run["dp"]["min_period_s"] = dp_min_period_s
    write_toml(run, cfg)
    local = Path(sys.executable).parent / "py-spy"  # in the same venv, even when it is not on PATH
    spy = shutil.which("py-spy") or (str(local) if local.exists() else None)
    rate = None if mode == "compute_bound" else bandwidth_mbit
    with NetBed([rate] * 5, subnet=30) as bed:
        swarm = BedSwarm(bed, cfg, work / "swarm", plaintext=not tls)
        s0 = swarm.wait_status(
            lambda s: s["step"] >= warmup and sum(p["state"] in ("active", "idle") for p in s["peers"]) == 4,
            300,
            f"4 live peers and step {warmup}",
        )
        roots = [p.pid for p in swarm.peers]
        before = _processes()
        kids = [
            pid
            for root in roots
            for pid in _tree(root, before)
            if pid != root and not before[pid][2].startswith("p2pd")
        ]

        def record(pid: int, out: Path) -> subprocess.Popen:
            return subprocess.Popen(
                [
                    spy,
                    "record",
                    "-d",
                    str(int(seconds)),
                    "-r",
                    "40",
                    "-f",
                    "raw",
                    "-o",
                    str(out),
                    "-p",
                    str(pid),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        spies = [record(pid, work / f"spy{i}.txt") for i, pid in enumerate(roots)] if spy else []
        spies += [record(pid, work / f"kid{i}.txt") for i, pid in enumerate(kids)] if spy else []
        spies += [record(swarm.bootstrap.pid, work / "boot.txt")] if spy else []
        t0 = time.monotonic()
        time.sleep(seconds)
        dt = time.monotonic() - t0
        after = _processes()
        for q in spies:
            q.wait()
        s1 = swarm.wait_status(lambda s: True, 30, "a status")
    cpu = collections.Counter()
    for root in roots + [swarm.bootstrap.pid]:
        for pid in _tree(root, after):
            if pid in before:
                kind = "bootstrap (tracker, DHT)" if root == swarm.bootstrap.pid else _kind(pid, root, after[pid][2])
                cpu[kind] += after[pid][1] - before[pid][1]
    share = {k: round(v / ((os.cpu_count() or 1) * dt), 3) for k, v in cpu.most_common()}
    checks = (
        {
            "peer main processes": checks_breakdown(sorted(work.glob("spy*.txt"))),
            "hivemind python children (DHT, averager)": checks_breakdown(sorted(work.glob("kid*.txt"))),
            "bootstrap (tracker, DHT)": checks_breakdown([f for f in [work / "boot.txt"] if f.exists()]),
        }
        if spy
        else {}
    )
    return {
        "mode": mode,
        "tls": tls,
        "bandwidth_mbit": rate,
        "dp_every": dp_every,
        "dp_min_period_s": run["dp"].get("min_period_s", "run default"),
        "window_s": round(dt, 1),
        "tokens_per_s": s1["tokens_per_s"],
        "steps": [s0["step"], s1["step"]],
        "cpu_seconds": {k: round(v, 2) for k, v in cpu.most_common()},
        "cpu_share_of_machine": share,
        "checks": checks or "py-spy not installed",
        "checks_share_of_machine": share_of_machine(checks, share) if checks else None,
        "peer_main_process": breakdown(sorted(work.glob("spy*.txt")))
        if spy
        else "py-spy not installed (pip install py-spy)",
        "hivemind_python_children": children_breakdown(sorted(work.glob("kid*.txt")))
        if spy
        else "py-spy not installed",
        "workdir": str(work),
    }


def run_profiles(tls: str = "on", repeat: int = 1, **kwargs) -> dict:
    """`repeat` windows per TLS setting (`tls`: "on", "off" or "both"), the settings interleaved
    so that the box's drift falls on both alike; with "both", their medians side by side."""
    settings = {"on": [True], "off": [False], "both": [True, False]}[tls]
    runs = []
    for i in range(repeat):
        for on in settings:
            print(
                f"bench profile: window {len(runs) + 1} of {repeat * len(settings)} (tls {'on' if on else 'off'})",
                file=sys.stderr,
                flush=True,
            )
            runs.append(run_profile(tls=on, **kwargs))
    if len(runs) == 1:
        return runs[0]
    return {"compare": compare(runs), "runs": runs}


def main_json(path: Path | None, **kwargs) -> dict:
    from peer.bench import emit_json

    return emit_json(run_profiles(**kwargs), path)
