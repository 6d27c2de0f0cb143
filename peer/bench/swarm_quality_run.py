"""The swarms of `anchormesh bench swarm-quality` (peer/bench/swarm_quality.py): their run.toml, and
a bootstrap and its peers started as processes on loopback and run to the token budget.

Why a module of its own: starting, watching and always stopping processes is apart from what the
bench compares; every process it starts is stopped by its pid.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from peer.bench.proc_memory import rss_gb, tree_pss_gb
from peer.bench.quality_rows import QualitySetup
from peer.config import TINY_MODEL_PREFIX
from peer.errors import ConfigError

# the dense swarm: only its links differ from the recommended run
DENSE_LINKS = {"codec": {"scheme": "mask", "mask": {"drop": 0.0}}}
# glibc's arenas: at its default (8 per core) four SmolLM2 peers and this process outgrew 24 GB
PEER_ENV = {"MALLOC_ARENA_MAX": "2"}


def swarm_toml(model: str, setup: QualitySetup, data: Path, replicas: int, swarm: str) -> str:
    """The swarm's run.toml: the model in 2 stages, the rows' sizes, the prepared data, the token
    budget; the codec and everything else are the defaults (the recommended run), except the
    dense swarm's links."""
    if setup.micro_batches % replicas:
        raise ConfigError("--replicas", replicas, f"must divide the rows' {setup.micro_batches} micro-batches per step")
    tiny = model.startswith(TINY_MODEL_PREFIX)
    budget = setup.adapt_steps * setup.micro_batches * setup.micro_batch_size * setup.seq_len
    sections: dict[str, dict] = {
        "model": {
            "name": model,
            "num_stages": setup.model.num_stages,
            "max_seq_len": max(setup.seq_len, setup.model.max_seq_len if tiny else 64),
            **(
                {
                    "hidden_size": setup.model.hidden_size,
                    "num_layers": setup.model.num_layers,
                    "num_heads": setup.model.num_heads,
                }
                if tiny
                else {}
            ),
        },
        "optim": {"lr": setup.adapt_lr},
        "pipeline": {
            "micro_batch_size": setup.micro_batch_size,
            "micro_batches": setup.micro_batches // replicas,
            "seq_len": setup.seq_len,
        },
        "data": {"prepared": str(data)},
        # only the exit checkpoint (the weights scored), and no replica of another stage's state:
        # a durability feature that holds that state (0.8 GB for SmolLM2's stage 1) and pulls it
        # mid-run; with it four SmolLM2 peers and this process outgrew a 24 GB machine
        "checkpoint": {"every": 10_000, "replicate_every_s": 0.0},
        "codec": {"seed": setup.seed, **(DENSE_LINKS["codec"] if swarm == "dense" else {})},
    }
    lines = [f"seed = {setup.seed}", f"token_budget = {budget}"]
    for name, values in sections.items():
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, dict)]
        for sub, kv in nested.items():
            lines.append(f"[{name}.{sub}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in kv.items()]
    return "\n".join(lines) + "\n"


def run_swarm(work: Path, toml: str, peers: int, timeout_s: float, budget: int = 0) -> dict:
    """Start the bootstrap and `peers` peers on `toml`, wait until the tracker stops the run at
    its token budget and every peer has left, and return the tracker's last status and timings.
    Every process started is stopped, by pid, whatever happens."""
    import grpc

    from peer.client.status import status_dict
    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap
    from peer.security.auth import Credentials, tracker_channel
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire import anchormesh_pb2_grpc as pbg

    work.mkdir(parents=True, exist_ok=True)
    (work / "run.toml").write_text(toml)
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    last, first_step, done = None, None, None
    peak: dict[int, float] = {}  # process -> the most resident memory seen, GB (a peer killed for memory shows here)
    peak_tree: dict[int, float] = {}  # process -> the most Pss of it and its children (averaging process, p2pd), GB
    try:
        procs.append(
            start_process(
                ["bootstrap", "--config", str(work / "run.toml"), "--state-dir", str(work / "boot")], work / "boot.log"
            )
        )
        info = wait_for_bootstrap(work / "boot", procs[0], work / "boot.log", timeout_s=300)
        for i in range(peers):
            args = [
                "peer",
                "--tracker",
                info["tracker"],
                "--token",
                f"@{work}/boot/bootstrap.json",
                "--state-dir",
                str(work / f"p{i}"),
            ]
            procs.append(start_process(args, work / f"p{i}.log", **PEER_ENV))
        with tracker_channel(info["tracker"], Credentials(token=info["token"])) as channel:
            stub = pbg.StatusStub(channel)
            shown = 0.0
            while True:
                now = time.monotonic()
                for k, proc in enumerate(procs):
                    peak[k] = max(peak.get(k, 0.0), rss_gb(proc.pid) or 0.0)
                    peak_tree[k] = max(peak_tree.get(k, 0.0), tree_pss_gb(proc.pid) or 0.0)
                try:
                    last = stub.GetStatus(pb.StatusRequest(), timeout=10)
                except grpc.RpcError as exc:
                    print(f"  status: {exc.code().name}", flush=True)
                if last is not None and first_step is None and last.step > 0:
                    first_step = now
                peers_left = all(p.poll() is not None for p in procs[1:])
                if peers_left:
                    done = now
                    break
                if now - t0 > timeout_s:
                    raise RuntimeError(f"the swarm did not finish within {timeout_s:.0f} s (logs in {work})")
                if last is not None and now - shown >= 30:
                    shown = now
                    rate = last.tokens / (now - first_step) if first_step and now > first_step else 0.0
                    eta = f", ETA {(budget - last.tokens) / rate:.0f} s" if budget and rate else ""
                    loss = f", loss {last.loss:.3f}" if last.loss == last.loss and last.step else ""
                    print(
                        f"  step {last.step}, {last.tokens} tokens{loss}, {rate:.0f} tokens/s{eta} ({now - t0:.0f} s since launch)",
                        flush=True,
                    )
                time.sleep(2.0)
    finally:
        stop_processes(procs)
    if last is None:
        raise RuntimeError(f"the tracker never answered (logs in {work})")
    s = status_dict(last)
    return {
        "status": {
            k: s.get(k)
            for k in (
                "state",
                "reason",
                "step",
                "tokens",
                "loss",
                "pp_bytes_per_token",
                "pp_state_bytes_per_token",
                "dp_bytes_per_token",
                "anchor_bytes_per_token",
                "config_digest",
            )
        },
        # per peer, from its own counters: where the bytes went, and what the link tuner chose
        "peers": [
            {
                k: p.get(k)
                for k in (
                    "id",
                    "stage",
                    "state",
                    "step",
                    "bytes_in",
                    "bytes_out",
                    "anchor_bytes_out",
                    "pp_state_bytes_out",
                    "dp_bytes_out",
                    "link_mbit",
                    "pp_keep",
                    "reason",
                )
            }
            for p in s.get("peers", [])
        ],
        "seconds": done - t0 if done else None,
        "startup_s": first_step - t0 if first_step else None,
        "train_seconds": done - first_step if done and first_step else None,
        "peak_rss_gb": {("bootstrap" if k == 0 else f"p{k - 1}"): round(v, 2) for k, v in peak.items()},
        "peak_tree_pss_gb": {("bootstrap" if k == 0 else f"p{k - 1}"): round(v, 2) for k, v in peak_tree.items()},
        "exit_codes": {f"p{k - 1}": p.returncode for k, p in enumerate(procs) if k},
    }
