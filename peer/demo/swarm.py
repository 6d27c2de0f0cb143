"""`anchormesh demo`: a real local swarm — bootstrap plus peers as separate processes.

Starts `anchormesh bootstrap` and `peers` `anchormesh peer` processes on loopback (the tiny
default run, or with `--model` a pretrained model such as `smollm2-135m`), shows the
tracker's status table live, and after `seconds` of training (or Ctrl-C) stops every process
it started — by pid, SIGTERM first, SIGKILL after a grace period — and prints a summary.

The clock starts at the run's first step, not at launch: on a busy machine starting the
processes (hivemind's DHT, p2pd, loading the model) took most of a fixed window, and a demo
could end at step 0. Startup has its own limit (`STARTUP_S`, longer with a pretrained model);
past it the demo stops and says so (`startup_s`: null in the summary, exit 1).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from peer.client.status import render
from peer.config import ModelConfig
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg


def start_process(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    """`anchormesh ARGS` as its own process (own session, so its children can be killed with it),
    one torch thread, output to `log`; `env` adds environment variables."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen(
        [sys.executable, "-m", "peer.cli", *args],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=full_env,
        start_new_session=True,
    )


def wait_for_bootstrap(state_dir: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> dict:
    """The bootstrap's `bootstrap.json` once it is written; RuntimeError (with its log) if the
    process dies or `timeout_s` passes first."""
    path = state_dir / "bootstrap.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"bootstrap did not start; its log ({log}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return json.loads(path.read_text())


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM each process (it shuts down its own DHT/averager children), wait up to `grace_s`,
    then SIGKILL each one's process group (its session: nothing else is in it), so nothing is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the process if still there, and any child it left
        except ProcessLookupError:
            pass
        p.wait()


# What `demo --model` changes in the recommended run (the config dataclasses' defaults), and why:
# it trains a pretrained model on this machine's CPUs, so its micro-batches are few and short and
# stage 0 reads little text. Everything else (codec, staleness, optimizer) is the recommended run.
DEMO_CPU_SIZES: dict[str, dict[str, int]] = {
    "model": {"max_seq_len": 128},
    "pipeline": {"micro_batch_size": 2, "micro_batches": 2, "seq_len": 128},
    "data": {"max_bytes": 400_000},
}


def model_run_toml(model: str) -> str:
    """The demo's run.toml for a pretrained model: the model, cut in 2 stages, and
    `DEMO_CPU_SIZES`; the rest is left to the defaults. The model is resolved first, so a model
    that is not installed fails here, before any process."""
    from peer.model.loading import resolve_dims

    resolve_dims(ModelConfig(name=model, num_stages=2))
    sections = {**DEMO_CPU_SIZES, "model": {"name": model, "num_stages": 2, **DEMO_CPU_SIZES["model"]}}
    lines = [
        f"# anchormesh demo --model {model}: the recommended run with the demo's CPU sizes (`anchormesh config show --config` this file)"
    ]
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


STARTUP_S = {"tiny": 180.0, "pretrained": 900.0}  # launch to first step, at most


def run_swarm_demo(seconds: float = 90.0, peers: int = 4, model: str | None = None) -> dict:
    """`model`: a pretrained model instead of the tiny default run (see `model_run_toml`);
    `seconds`: of training, counted from the run's first step."""
    run_toml = model_run_toml(model) if model else None
    work = Path(tempfile.mkdtemp(prefix="anchormesh-swarm-"))
    procs: list[subprocess.Popen] = []
    last: pb.RunStatus | None = None
    t0, started = time.monotonic(), None
    try:
        config = []
        if run_toml:
            (work / "run.toml").write_text(run_toml)
            config = ["--config", str(work / "run.toml")]
        procs.append(start_process(["bootstrap", "--state-dir", str(work), *config], work / "bootstrap.log"))
        info = wait_for_bootstrap(work, procs[0], work / "bootstrap.log")
        print(
            f"bootstrap up: run {info['run_id']}, tracker {info['tracker']}; starting {peers} peers (logs in {work})",
            flush=True,
        )
        for i in range(peers):
            procs.append(
                start_process(
                    ["peer", "--initial-peers", info["dht_maddrs"][0]],
                    work / f"peer{i}.log",
                    ANCHORMESH_TOKEN=info["token"],
                    ANCHORMESH_TRACKER_KEY=info["tracker_key"],
                )
            )
        startup_limit = STARTUP_S["pretrained" if model else "tiny"]
        with grpc.insecure_channel(info["tracker"]) as channel:
            stub = pbg.StatusStub(channel)
            while True:
                last = stub.GetStatus(pb.StatusRequest(), timeout=10)
                now = time.monotonic()
                if started is None and last.step > 0:
                    started = now
                    print(f"first step {now - t0:.0f} s after launch", flush=True)
                if started is None and now - t0 > startup_limit:
                    print(
                        f"\nno step within {startup_limit:.0f} s of launch: see the status above and the logs in {work}",
                        flush=True,
                    )
                    break
                if started is not None and now - started >= seconds:
                    break
                phase = (
                    f"starting, {now - t0:.0f} s"
                    if started is None
                    else f"training {now - started:.0f}/{seconds:.0f} s"
                )
                sys.stdout.write("\x1b[2J\x1b[H" if sys.stdout.isatty() else "\n")
                sys.stdout.write(f"anchormesh swarm demo — {phase} (Ctrl-C ends it)\n\n{render(last)}\n")
                sys.stdout.flush()
                time.sleep(2.0)
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
    finally:
        stop_processes(procs)
    left = [p.pid for p in procs if p.poll() is None]
    summary = {
        "run_id": last.run_id if last else None,
        "step": last.step if last else 0,
        "tokens": last.tokens if last else 0,
        "loss": last.loss if last else None,
        "pp_bytes_per_token": last.pp_bytes_per_token if last else 0.0,
        "startup_s": round(started - t0, 1) if started is not None else None,
        "processes_left": left,
        "data": {"epoch": last.data.epoch, "position": last.data.position, "tokens_seen": last.data.tokens_seen}
        if last and last.HasField("data")
        else None,
    }
    print(
        f"summary: {json.dumps(summary)}; every process stopped"
        if not left
        else f"summary: {json.dumps(summary)}; STILL RUNNING: {left}"
    )
    return summary
