"""The parsers of the commands that talk to a running swarm: `status`, `ban`, `health`, `export`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

env = os.environ.get


def add_plaintext(parser: argparse.ArgumentParser) -> None:
    """`--insecure-plaintext` for a client of a run whose bootstrap runs with it (no TLS off
    loopback): without it the client expects TLS off loopback and names the flag when it meets none."""
    parser.add_argument(
        "--insecure-plaintext",
        action="store_true",
        default=bool(env("ANCHORMESH_INSECURE_PLAINTEXT")),
        help="talk to a run whose bootstrap runs with --insecure-plaintext (no TLS off loopback); default: $ANCHORMESH_INSECURE_PLAINTEXT",
    )


def add_status(sub: argparse._SubParsersAction) -> None:
    """`anchormesh status`: a run's stages, peers, loss and throughput."""
    status = sub.add_parser("status", help="show a run's stages, peers, loss and throughput")
    status.add_argument(
        "--tracker",
        default=env("ANCHORMESH_TRACKER") or None,
        help="tracker host:port, or the address line HOST:PORT#KEY (then a run with TLS needs no --tls-ca); default: $ANCHORMESH_TRACKER",
    )
    status.add_argument(
        "--json",
        action="store_true",
        help="print the status as one JSON object (with --watch: one a line; see docs/status.md)",
    )
    status.add_argument(
        "--watch",
        action="store_true",
        help="keep updating: the live dashboard on a terminal, plain snapshots into a pipe or a file",
    )
    status.add_argument(
        "--token",
        default=env("ANCHORMESH_TOKEN") or None,
        help="the run token, or @FILE (a bootstrap.json also gives the key and the CA): a run off loopback shows its status only with it, unless its bootstrap runs with --public-status; default: $ANCHORMESH_TOKEN",
    )
    status.add_argument(
        "--tls-ca",
        default=env("ANCHORMESH_TLS_CA") or None,
        help="the run's CA certificate when it uses TLS (PEM file or bootstrap.json); default: $ANCHORMESH_TLS_CA",
    )
    add_plaintext(status)


def add_ban(sub: argparse._SubParsersAction) -> None:
    """`anchormesh ban`: the operator bans a peer's key, or readmits it."""
    ban = sub.add_parser(
        "ban",
        help="operator: ban a peer's key from the run (its calls are refused everywhere), or readmit it with --unban",
    )
    ban.add_argument("peer", help="peer id (as in the status) or key fingerprint")
    ban.add_argument(
        "--bootstrap",
        type=Path,
        default=Path("runs/bootstrap/bootstrap.json"),
        help="the bootstrap's bootstrap.json: the tracker's address and the operator key (default runs/bootstrap/bootstrap.json)",
    )
    ban.add_argument("--reason", default="", help="why (shown in the status and the peer's log)")
    ban.add_argument("--unban", action="store_true", help="readmit the key instead")


def add_health(sub: argparse._SubParsersAction) -> None:
    """`anchormesh health`: one gRPC call, for container health checks."""
    health = sub.add_parser(
        "health",
        help="one gRPC call: does a peer's Stage service (Ping) or a tracker (--tracker: GetStatus) answer? exit 0 or 1 (container health checks)",
    )
    health.add_argument(
        "--address", required=True, help="host:port of the peer's Stage service, or of the tracker with --tracker"
    )
    health.add_argument(
        "--tracker", action="store_true", help="check a tracker's Status service instead of a peer's Stage service"
    )
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    health.add_argument(
        "--tls-ca",
        default=env("ANCHORMESH_TLS_CA") or None,
        help="the run's CA certificate when it uses TLS (PEM file or bootstrap.json); default: $ANCHORMESH_TLS_CA",
    )


def add_export(sub: argparse._SubParsersAction) -> None:
    """`anchormesh export`: a run's newest weights as a Hugging Face model folder."""
    export = sub.add_parser(
        "export",
        help="a run's newest weights (the live swarm, or peers' checkpoints) as a Hugging Face model folder (AutoModelForCausalLM.from_pretrained loads it)",
    )
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--tracker", help="tracker host:port, or the address line HOST:PORT#KEY: export the live swarm's newest weights"
    )
    source.add_argument(
        "--checkpoints",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="export from shard checkpoints instead: peers' --state-dir folders (copied from the volunteers), newest valid checkpoint per stage; works after the run has ended",
    )
    export.add_argument(
        "--run", default=None, help="with --checkpoints: the run id, when the folders hold checkpoints of several runs"
    )
    export.add_argument(
        "--out", required=True, type=Path, help="folder to write config.json, model.safetensors and the tokenizer into"
    )
    export.add_argument(
        "--timeout", type=float, default=300.0, help="seconds one stage's download may take (default 300)"
    )
    export.add_argument(
        "--token",
        default=env("ANCHORMESH_TOKEN") or None,
        help="with --tracker: the run token, or @FILE (a bootstrap.json); default: $ANCHORMESH_TOKEN",
    )
    export.add_argument(
        "--tls-ca",
        default=env("ANCHORMESH_TLS_CA") or None,
        help="with --tracker, when the run uses TLS: its CA certificate (PEM file or bootstrap.json); default: $ANCHORMESH_TLS_CA",
    )
    add_plaintext(export)
