"""`anchormesh doctor`: gather each check's inputs on this machine (and from the tracker with
`--tracker`), print one line per check, exit 0 when nothing failed and 1 when a check failed.

Nothing heavy is imported before the flags are parsed: torch and grpc load inside the checks
that need them, so `anchormesh doctor --bad-flag` answers at once (exit 2)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from peer.doctor import checks
from peer.doctor.checks import Check
from peer.errors import ConfigError


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    """The `doctor` subcommand on the entry point's parser; its flags are the peer's where they
    mean the same (`anchormesh peer --help`)."""
    env = os.environ.get
    d = sub.add_parser("doctor", help="check this machine before joining a run: GPU, torch, shm, ports, disk, memory")
    d.add_argument(
        "--tracker",
        default=env("ANCHORMESH_TRACKER") or None,
        help="the run's tracker (HOST:PORT#KEY from bootstrap.json, or host:port): also check its version and the run's memory plan here (default: $ANCHORMESH_TRACKER)",
    )
    d.add_argument("--token", default=env("ANCHORMESH_TOKEN") or None, help="the run token, or @FILE (as for peer)")
    d.add_argument("--tls-ca", default=env("ANCHORMESH_TLS_CA") or None, help="the run's CA certificate (as for peer)")
    d.add_argument("--host", default="127.0.0.1", help="the address the peer would bind (as for peer)")
    d.add_argument("--grpc-port", type=int, default=0, help="the Stage service port the peer would use (0 = any free)")
    d.add_argument("--dht-port", type=int, default=0, help="the DHT port the peer would use (0 = any free)")
    d.add_argument(
        "--device", default=env("ANCHORMESH_DEVICE", "auto"), help="where the peer would train (as for peer)"
    )
    d.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="the --state-dir the peer will use: its free space is checked (default: the current directory)",
    )
    d.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the tracker (default 10)")


def _smi() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _torch_facts() -> tuple[str | None, str | None, bool]:
    try:
        import torch
    except ImportError:
        return None, None, False
    return torch.__version__, torch.version.cuda, torch.cuda.is_available()


def _shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _bind_error(host: str, number: int) -> str:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, number))
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def _disk_free(path: Path) -> int | None:
    """Free bytes of the state dir, or of its nearest existing parent (it is made at the first run)."""
    probe = path.resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _ask_tracker(args) -> tuple[Check, object | None, float | None]:
    """The tracker line, the run's config (None when it could not be had) and this clock's offset
    from the tracker's (its answer's time against the middle of the call; None when unknown)."""
    import grpc

    from peer.runtoml import config_from_dict
    from peer.security import auth
    from peer.security.call_check import NO_TOKEN_HINT
    from peer.security.exposure import client_ca, resolve_access
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire import anchormesh_pb2_grpc as pbg
    from peer.wire.version import wire_version

    access = resolve_access(args.tracker, [], None, args.token, args.tls_ca, False)
    token = auth.read_token(args.token)
    if not token:
        return checks.tracker(args.tracker, f"needs the run token: {NO_TOKEN_HINT}"), None, None
    try:
        with auth.tracker_channel(access.tracker, auth.Credentials(token=token), tls_ca=client_ca(access)) as ch:
            sent = time.time()
            run = pbg.TrackerStub(ch).GetConfig(pb.ConfigRequest(), timeout=args.timeout)
            back = time.time()
    except grpc.RpcError as exc:
        why = " ".join((exc.details() or "").split())
        return checks.tracker(access.tracker, f"{exc.code().name}: {why}"), None, None
    line = checks.tracker(access.tracker, "", run.run_id, run.wire_version, wire_version())
    skew = (sent + back) / 2 - run.server_time_unix if run.server_time_unix else None
    return line, config_from_dict(json.loads(run.run_config_json)), skew


def _memory(cfg, device: str, state_dir: Path | None) -> Check:
    """The daemon's own memory plan of every stage (peer/daemon/memory.py), as the peer sends it at Join."""
    from peer.daemon.memory import free_bytes, plan_stages
    from peer.model.placement import parse_device, resolve_placement

    placement = resolve_placement(parse_device(device), cfg.compute)
    plans = plan_stages(cfg, placement, dp_group=True, replica_in_memory=state_dir is None)
    free = free_bytes(placement.device)
    budget = int(cfg.compute.memory_budget_gib * 2**30)
    return checks.memory(
        str(placement.device), [p.need(placement.device) for p in plans], min(budget, free) if budget else free
    )


def run_doctor(args) -> int:
    """Print the checks; the exit code (0: nothing failed, 1: a check failed). Bad flags raise
    ConfigError (the entry point exits 2)."""
    for flag in ("grpc_port", "dht_port"):
        if not 0 <= getattr(args, flag) <= 65535:
            raise ConfigError(f"--{flag.replace('_', '-')}", getattr(args, flag), "must be a port number in [0, 65535]")
    if not args.timeout > 0:
        raise ConfigError("--timeout", args.timeout, "must be > 0")
    results: list[Check] = []

    def say(c: Check) -> None:
        results.append(c)
        print(c.line(), flush=True)

    smi = _smi()
    say(checks.gpu(smi))
    say(checks.torch_build(*_torch_facts(), gpu_seen=bool(smi and smi.strip())))
    say(checks.shm(_shm_bytes()))
    for flag in ("--grpc-port", "--dht-port"):
        number = getattr(args, flag[2:].replace("-", "_"))
        say(checks.port(flag, args.host, number, _bind_error(args.host, number)))
    state_dir = args.state_dir or Path(".")
    say(checks.disk(str(state_dir), _disk_free(state_dir), given=args.state_dir is not None))
    if args.tracker:
        line, cfg, skew = _ask_tracker(args)
        say(line)
        say(checks.clock(skew, "the tracker did not answer, or is a build that reports no wall-clock time"))
        if cfg is None:
            say(checks.memory("", None, 0, "the run config could not be fetched (see the tracker line)"))
        else:
            try:
                say(_memory(cfg, args.device, args.state_dir))
            except ConfigError as exc:
                say(Check("memory", checks.FAIL, str(exc)))
    else:
        say(checks.clock(None, "no --tracker to compare with"))
        say(checks.memory("", None, 0, "no --tracker: pass it (and --token) to check the run's memory plan here"))
    failed = [c.name for c in results if c.status == checks.FAIL]
    print(f"doctor: {'failed: ' + ', '.join(failed) if failed else 'nothing failed'}", file=sys.stderr)
    return checks.exit_code(results)
