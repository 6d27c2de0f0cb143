"""What `status`, `export`, `ban` and `health` do with their parsed flags: each checks its
flags and files (token, CA) before it dials anything or imports torch."""

from __future__ import annotations

import argparse

from peer.errors import ConfigError

NO_TRACKER = "give the tracker: --tracker HOST:PORT or the address line HOST:PORT#KEY, or set ANCHORMESH_TRACKER"


def run_status(args: argparse.Namespace) -> None:
    """`anchormesh status`: one query, or a stream with --watch."""
    from peer.security.auth import read_token
    from peer.security.exposure import client_ca, resolve_access

    if not args.tracker:
        raise ConfigError("--tracker", None, NO_TRACKER)
    token = read_token(args.token)
    access = resolve_access(args.tracker, [], None, args.token, args.tls_ca, args.insecure_plaintext)
    from peer.client.status import run_status as show

    show(access.tracker, args.json, args.watch, token=token, tls_ca=client_ca(access))


def run_export(args: argparse.Namespace) -> None:
    """`anchormesh export`: from the live swarm (needs the token) or from checkpoints."""
    from peer.security.auth import read_token
    from peer.security.call_check import NO_TOKEN_HINT
    from peer.security.exposure import client_ca, resolve_access
    from peer.security.tls import read_ca

    if not args.timeout > 0:
        raise ConfigError("--timeout", args.timeout, "must be > 0")
    if args.run and not args.checkpoints:
        raise ConfigError("--run", args.run, "only goes with --checkpoints")
    token = read_token(args.token)
    if args.tracker and not token:
        raise ConfigError("--token", None, f"exporting a live run needs its token: {NO_TOKEN_HINT}")
    # the address line works here too
    access = (
        resolve_access(args.tracker, [], None, args.token, args.tls_ca, args.insecure_plaintext)
        if args.tracker
        else None
    )
    tls_ca = client_ca(access) if access else read_ca(args.tls_ca)
    from peer.client.export import run_export as export  # imports torch and transformers

    raise SystemExit(
        export(
            access.tracker if access else None,
            args.out,
            args.timeout,
            checkpoints=args.checkpoints,
            run_id=args.run,
            token=token,
            tls_ca=tls_ca,
        )
    )


def run_ban(args: argparse.Namespace) -> None:
    """`anchormesh ban`: the operator's signed ban (or --unban) sent to the tracker."""
    from peer.client.ban import run_ban as ban

    raise SystemExit(ban(args.bootstrap, args.peer, args.reason, args.unban))


def run_health(args: argparse.Namespace) -> None:
    """`anchormesh health`: exit 0 when the service answers, 1 when not."""
    from peer.security.tls import read_ca

    if not args.timeout > 0:
        raise ConfigError("--timeout", args.timeout, "must be > 0")
    ca = read_ca(args.tls_ca)
    from peer.client.health import run_health as check

    raise SystemExit(check(args.address, args.tracker, args.timeout, ca))
