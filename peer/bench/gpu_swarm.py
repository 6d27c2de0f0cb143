"""Parts (b) and (c) of `anchormesh bench gpu` (peer/bench/gpu.py): a swarm of processes on the
device (one peer killed and restarted from its checkpoint), and a peer refused for memory.

Why a module of its own: these parts start real processes (the bootstrap, the peers) and read
the run off the tracker's status; every process started is stopped whatever happens.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

log = logging.getLogger("anchormesh.bench.gpu")

SWARM_RUN = """
seed = 1
[model]
name = "tiny-llama"
num_stages = 2
hidden_size = {hidden}
num_layers = 4
num_heads = 4
max_seq_len = 128
[codec]
scheme = "lowrank"
[codec.lowrank]
rank = 32
[dp]
inner_steps = 5
[anchor]
every = 10
[spectral]
mode = "paper"
[pipeline]
micro_batch_size = 4
micro_batches = 2
seq_len = 128
eval_every = 10
[checkpoint]
every = 10
"""


def swarm(device: str, root: Path, steps: int = 40, kill_at: int = 20, timeout_s: float = 240.0) -> dict:
    """Part (b): a 2 x 2 swarm on `device`; one peer SIGKILLed at `kill_at` and restarted."""
    from peer.client.view import status_dict
    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

    (root / "run.toml").write_text(SWARM_RUN.format(hidden=512 if device.startswith("cuda") else 64))
    procs, t0 = [], time.monotonic()

    def status() -> dict | None:
        import grpc

        from peer.security import auth
        from peer.wire import anchormesh_pb2 as pb
        from peer.wire import anchormesh_pb2_grpc as pbg

        try:  # the Status service is open to anyone who can reach the tracker
            with auth.open_channel(info["tracker"], None) as channel:
                return status_dict(pbg.StatusStub(channel).GetStatus(pb.StatusRequest(), timeout=5))
        except grpc.RpcError:  # not up yet
            return None

    def wait(what, why: str) -> dict:
        while time.monotonic() - t0 < timeout_s:
            s = status()
            if s is not None and what(s):
                return s
            time.sleep(1.0)
        raise TimeoutError(f"swarm: timed out waiting for {why}; last status step {s and s.get('step')}")

    result: dict = {"device": device, "steps": steps}
    try:
        procs.append(
            start_process(
                ["bootstrap", "--config", str(root / "run.toml"), "--state-dir", str(root / "boot")], root / "boot.log"
            )
        )
        info = wait_for_bootstrap(root / "boot", procs[0], root / "boot.log")
        peer_args = lambda i: [
            "peer",
            "--tracker",
            info["tracker"],
            "--token",
            info["token"],
            "--device",
            device,
            "--state-dir",
            str(root / f"peer{i}"),
        ]  # noqa: E731
        peers = {i: start_process(peer_args(i), root / f"peer{i}.log") for i in range(4)}
        procs += peers.values()
        s = wait(lambda s: s["step"] >= 1, "the first step")
        result["seconds_to_first_step"] = time.monotonic() - t0
        s = wait(lambda s: s["step"] >= kill_at, f"step {kill_at}")
        victim = next(p for p in s["peers"] if p["stage"] == 1 and p["state"] in ("active", "idle"))
        index = next(i for i in range(4) if victim["id"] in (root / f"peer{i}.log").read_text())
        peers[index].send_signal(
            signal.SIGKILL
        )  # its process group (p2pd, hivemind's children) is killed by stop_processes
        peers[index].wait(10)
        result["killed"] = {"peer": victim["id"], "at_step": s["step"]}
        procs.append(start_process(peer_args(index), root / f"peer{index}-restart.log"))

        def done(s: dict) -> bool:  # 4 live peers at `steps`, each with a round behind it
            live = [p for p in s["peers"] if p["state"] in ("active", "idle")]
            return s["step"] >= steps and len(live) >= 4 and all(p["dp_rounds"] for p in live)

        s = wait(done, f"step {steps} with 4 live peers that each averaged")
        restart_log = (root / f"peer{index}-restart.log").read_text()
        result["dp_refusals"] = [
            line.split("anchormesh.")[-1][:300]
            for f in sorted(root.glob("peer*.log"))
            for line in f.read_text().splitlines()
            if "result rejected" in line
        ]
        live = [p for p in s["peers"] if p["state"] in ("active", "idle")]
        result.update(
            {
                "step": s["step"],
                "loss": s["loss"],
                "eval_loss": s["eval_loss"],
                "anchor_age_steps": s["anchor_age_steps"],
                "anchor_priors_folded": sum(1 for p in live if p["anchor_id"]),
                "dp_rounds": {p["id"]: p["dp_rounds"] for p in live},
                "dp_rejected": sum(p["dp_rejected"] for p in live),
                "devices": sorted({p["device"] or "" for p in live}),
                "restart_resumed_from": "checkpoint"
                if "took the stage state of checkpoint" in restart_log
                else "group"
                if "took the stage state of a group member" in restart_log
                else None,
                "seconds": time.monotonic() - t0,
            }
        )
        result["ok"] = bool(
            min(result["dp_rounds"].values()) > 0
            and result["dp_rejected"] == 0
            and result["anchor_priors_folded"]
            and result["eval_loss"] is not None
            and result["restart_resumed_from"]
        )
    except (TimeoutError, RuntimeError, StopIteration) as exc:
        result.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        stop_processes(procs)
    log.info("swarm on %s: %s", device, json.dumps(result)[:400])
    return result


def memory_refusal(device: str, root: Path) -> dict:
    """Part (c): a budget no stage fits; the peer must exit 2 naming the estimate."""
    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

    (root / "run.toml").write_text(SWARM_RUN.format(hidden=64) + "[compute]\nmemory_budget_gib = 0.001\n")
    procs = [
        start_process(
            ["bootstrap", "--config", str(root / "run.toml"), "--state-dir", str(root / "boot")], root / "boot.log"
        )
    ]
    try:
        info = wait_for_bootstrap(root / "boot", procs[0], root / "boot.log")
        procs.append(
            start_process(
                ["peer", "--tracker", info["tracker"], "--token", info["token"], "--device", device], root / "peer.log"
            )
        )
        rc = procs[1].wait(timeout=120)
        text = (root / "peer.log").read_text()
        line = next((x for x in text.splitlines() if "no stage of this run fits" in x), "")
        return {
            "exit_code": rc,
            "message": line[-400:],
            "ok": rc == 2 and "needs" in line and "GiB" in line and "joined" not in text,
        }
    finally:
        stop_processes(procs)
