"""What `demo`, `config`, `bootstrap` and `peer` do with their parsed flags.

Each command checks its flags first and imports the heavy parts (torch, hivemind, transformers)
only after: a wrong invocation answers in a fraction of a second, not after the imports.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from peer.errors import ConfigError

DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def run_demo(args: argparse.Namespace) -> None:
    """`anchormesh demo`: the swarm demo (processes), or with --local the training core alone."""
    if not args.local:
        if args.peers < 1:
            raise ConfigError("--peers", args.peers, "must be >= 1")
        from peer.demo.swarm import run_swarm_demo

        summary = run_swarm_demo(
            seconds=args.seconds or (600.0 if args.model else 180.0), peers=args.peers, model=args.model
        )
        if summary["startup_s"] is None or summary["processes_left"]:
            raise SystemExit(1)
        return
    from peer.demo.local import run_demo as run_local_demo

    run_local_demo(
        seconds=args.seconds or 60.0,
        stages=args.stages,
        codec=args.codec,
        drop=args.drop,
        rank=args.rank,
        threads=args.threads,
    )


def run_config(args: argparse.Namespace) -> None:
    """`anchormesh config show|check`: the effective run.toml, or its validation."""
    from peer.client.run_config import render_json, render_toml
    from peer.runtoml import load_run

    resolved = load_run(args.config, args.set)
    if args.action == "show":
        print(render_json(resolved) if args.json else render_toml(resolved), end="\n" if args.json else "")
        return
    from bootstrap.prepare import prepare_run

    cfg = prepare_run(resolved.config)
    print(
        f"ok: run config {resolved.digest}: model {cfg.model.name} ({cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}), {cfg.model.num_stages} stages, codec {cfg.mask.scheme}"
    )


def run_bootstrap(args: argparse.Namespace) -> None:
    """`anchormesh bootstrap`: the run.toml and the token are read before the node starts."""
    from peer.runtoml import load_run
    from peer.security.auth import read_token

    config = load_run(args.config, args.set).config if (args.config or args.set) else None
    token = read_token(args.token)
    from bootstrap.node import run_bootstrap as start

    start(
        config,
        args.host,
        args.port,
        args.dht_port,
        args.state_dir,
        args.peer_timeout,
        metrics_port=args.metrics_port,
        announce_host=args.announce_host,
        new_run=args.new_run,
        token=token,
        insecure_plaintext=args.insecure_plaintext,
        public_status=args.public_status,
        dial_back=not args.no_dial_back,
    )


def check_peer_flags(args: argparse.Namespace) -> tuple[str, str | None]:
    """Every check of `anchormesh peer` that needs no heavy import: the flags' own values first,
    then the run (tracker or initial peers) and its token. Returns the token and the address to
    announce."""
    from peer.security.auth import read_token
    from peer.security.call_check import NO_TOKEN_HINT

    device = args.device.strip().lower()
    if not DEVICE.fullmatch(device):
        raise ConfigError("--device", args.device, "must be auto, cpu, cuda or cuda:N")
    if args.host in ("0.0.0.0", "::") and not args.announce_host:
        raise ConfigError(
            "--announce-host", None, f"required with --host {args.host}: other peers cannot dial {args.host}"
        )
    if args.threads < 1:
        raise ConfigError("--threads", args.threads, "must be >= 1")
    for flag in ("grpc_port", "dht_port", "metrics_port"):
        if getattr(args, flag) is not None and not 0 <= getattr(args, flag) <= 65535:
            raise ConfigError(f"--{flag.replace('_', '-')}", getattr(args, flag), "must be a port number in [0, 65535]")
    announce = announce_address(args)
    if not (args.tracker or args.initial_peers):
        raise ConfigError(
            "--tracker",
            None,
            "a peer needs the run: give --tracker HOST:PORT#KEY (or $ANCHORMESH_TRACKER) or --initial-peers (or $ANCHORMESH_INITIAL_PEERS)",
        )
    token = read_token(args.token)
    if not token:
        raise ConfigError("--token", None, f"a peer joins with the run's token: {NO_TOKEN_HINT}")
    return token, announce


def announce_address(args: argparse.Namespace) -> str | None:
    """--announce-host, with `auto` resolved to the local address that routes to the run."""
    from peer.address import AUTO, outward_address
    from peer.security.exposure import split_address

    if args.announce_host != AUTO:
        return args.announce_host
    if not (args.tracker or args.initial_peers):
        raise ConfigError("--announce-host", AUTO, "needs --tracker or --initial-peers to find the route out")
    try:
        found = outward_address(split_address(args.tracker)[0] if args.tracker else args.initial_peers[0])
    except ValueError as exc:
        raise ConfigError("--announce-host", AUTO, str(exc)) from None
    print(f"anchormesh peer: --announce-host auto: {found}", file=sys.stderr, flush=True)
    return found


def run_peer(args: argparse.Namespace) -> None:
    """`anchormesh peer`: flags, token, tracker key and TLS checked, then the daemon."""
    import faulthandler
    import signal

    from peer.security.exposure import resolve_access

    token, announce = check_peer_flags(args)
    # off loopback: the tracker's key is required, and TLS is on unless --insecure-plaintext
    access = resolve_access(
        args.tracker, args.initial_peers, args.tracker_key, args.token, args.tls_ca, args.insecure_plaintext, True
    )
    print(
        f"anchormesh peer: starting (pid {os.getpid()}); SIGUSR1 dumps every thread's stack to stderr",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from peer.model.placement import parse_device  # imports torch

    parse_device(args.device)  # no GPU, an index out of range: exit 2 now, before any process starts
    from peer.daemon.main import run_peer as start

    start(
        args.initial_peers,
        access.tracker,
        args.host,
        args.grpc_port,
        args.device,
        args.max_steps,
        args.state_dir,
        announce,
        dht_port=args.dht_port,
        metrics_port=args.metrics_port,
        threads=args.threads,
        token=token,
        tls_ca=access.ca,
        tracker_key=access.key,
        data_dir=args.data_dir,
        fetch_tls=access.fetch,
    )
