"""The parsers of the commands that start something: `demo`, `bootstrap`, `config`, `peer`.

Defaults from the environment are read here as plain strings; a value that must parse
(`$ANCHORMESH_THREADS`) is checked after parsing (peer/cli/environ.py), so `--help` always runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

env = os.environ.get


def add_demo(sub: argparse._SubParsersAction) -> None:
    """`anchormesh demo`: a local swarm, or the training core alone."""
    demo = sub.add_parser(
        "demo",
        help="a local swarm on this machine (bootstrap + peers as processes) training the tiny default run, status live",
    )
    demo.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="how long it trains, from the run's first step (default 180; 60 with --local)",
    )
    demo.add_argument("--peers", type=int, default=4, help="peers to start (default 4: 2 stages x 2)")
    demo.add_argument(
        "--model",
        default=None,
        help="train this pretrained model instead of the tiny default run (hub id, folder, .gguf file, smollm2-135m; each peer loads it: ~15 s for smollm2-135m, default --seconds 600)",
    )
    demo.add_argument(
        "--local", action="store_true", help="instead: the training core alone, all stages in this process"
    )
    demo.add_argument("--stages", type=int, default=2, help="with --local: pipeline stages")
    demo.add_argument(
        "--codec",
        choices=("transform", "lowrank", "mask"),
        default="transform",
        help="with --local: PP link codec (default transform)",
    )
    demo.add_argument(
        "--drop", type=float, default=0.95, help="with --local --codec mask: P(drop) of activation entries"
    )
    demo.add_argument("--rank", type=int, default=20, help="with --local --codec lowrank: coefficients per token")
    demo.add_argument("--threads", type=int, default=0, help="with --local: torch threads (0 = torch default)")


def add_bootstrap(sub: argparse._SubParsersAction) -> None:
    """`anchormesh bootstrap`: the first DHT node, the tracker and the status service."""
    boot = sub.add_parser("bootstrap", help="start a run: first DHT node, tracker and status service")
    boot.add_argument(
        "--config",
        help="run.toml (default: the recommended run on the tiny model, 2 stages); `anchormesh config show` prints what it runs",
    )
    boot.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one run.toml setting (repeatable), e.g. --set optim.lr=1e-4",
    )
    boot.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    boot.add_argument(
        "--announce-host",
        default=None,
        help="address peers dial to reach the bootstrap (default: --host); replaces the host in the published tracker address and the DHT's multiaddrs (a name becomes /dns4/NAME)",
    )
    boot.add_argument("--port", type=int, default=0, help="tracker gRPC port (0 = any free)")
    boot.add_argument("--dht-port", type=int, default=0, help="DHT TCP port (0 = any free)")
    boot.add_argument(
        "--state-dir",
        type=Path,
        default=Path("runs/bootstrap"),
        help="where bootstrap.json, the run state (tracker.json) and the DHT identity go; a bootstrap started again on it resumes that run",
    )
    boot.add_argument(
        "--new-run",
        action="store_true",
        help="start a new run even if --state-dir holds one (its tracker.json is replaced)",
    )
    boot.add_argument(
        "--peer-timeout", type=float, default=10.0, help="seconds without heartbeat before a peer is dead"
    )
    boot.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port; default: off)",
    )
    boot.add_argument(
        "--token",
        default=env("ANCHORMESH_TOKEN") or None,
        help="set the run token (or @FILE; at least 16 characters; default: $ANCHORMESH_TOKEN, else the one in --state-dir, else a new random one); a new one replaces the old for new joiners",
    )
    boot.add_argument(
        "--insecure-plaintext",
        action="store_true",
        help="UNSAFE: no TLS although an address is off loopback: activations, gradients and token ids cross the network in the clear, and anyone on the path can read or alter them (peers need --insecure-plaintext too)",
    )
    boot.add_argument(
        "--public-status",
        action="store_true",
        help="let anyone who reaches the tracker read the status (peers' ids, addresses, loss); off loopback it needs the run token by default",
    )
    boot.add_argument(
        "--no-dial-back",
        action="store_true",
        help="admit joiners without checking that their announced addresses answer (by default Join dials them back within 3 s and refuses a peer none of whose addresses answers); for a tracker that cannot reach its peers' network by design",
    )


def add_config(sub: argparse._SubParsersAction) -> None:
    """`anchormesh config show|check`: the run a run.toml makes, before anything starts."""
    config = sub.add_parser(
        "config", help="the run a run.toml (plus --set) makes, before anything starts: show it, or check it"
    )
    config.add_argument(
        "action",
        choices=("show", "check"),
        help="show: print the effective run.toml, each value with its source (default, tiny model, run.toml, --set); check: validate it as the bootstrap would, start nothing",
    )
    config.add_argument("--config", help="run.toml (default: none: the recommended run on the tiny model)")
    config.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (repeatable), e.g. --set model.name=smollm2-135m",
    )
    config.add_argument(
        "--json", action="store_true", help="show: one JSON object {digest, config, sources} instead of TOML"
    )


def add_peer(sub: argparse._SubParsersAction) -> None:
    """`anchormesh peer`: join a run and serve a stage."""
    peer = sub.add_parser("peer", help="join a run and serve a stage")
    peer.add_argument(
        "--initial-peers",
        nargs="*",
        default=env("ANCHORMESH_INITIAL_PEERS", "").split(),
        help="DHT multiaddrs of the run (from bootstrap.json); default: $ANCHORMESH_INITIAL_PEERS (space-separated)",
    )
    peer.add_argument(
        "--tracker",
        default=env("ANCHORMESH_TRACKER") or None,
        help='the tracker: the "address" of the bootstrap\'s bootstrap.json, HOST:PORT#KEY (its key lets the peer check the tracker and its TLS CA), or host:port (default: $ANCHORMESH_TRACKER, else found through the DHT)',
    )
    peer.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the Stage service and the DHT node bind to (0.0.0.0: all interfaces; then give --announce-host)",
    )
    peer.add_argument(
        "--announce-host",
        default=env("ANCHORMESH_ANNOUNCE_HOST") or None,
        help="address other peers dial to reach this one (default: $ANCHORMESH_ANNOUNCE_HOST, else --host); your public or LAN address behind 0.0.0.0 or a port forward; 'auto' = the local address that routes to the tracker (right on a LAN or with docker --network host, not behind NAT)",
    )
    peer.add_argument("--grpc-port", type=int, default=0, help="Stage service port (0 = any free)")
    peer.add_argument(
        "--dht-port",
        type=int,
        default=0,
        help="the peer's DHT node port (0 = any free; fix it to forward or publish it)",
    )
    peer.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve this peer's Prometheus metrics at http://HOST:PORT/metrics (0 = any free port; default: off)",
    )
    peer.add_argument(
        "--device",
        default=env("ANCHORMESH_DEVICE", "auto"),
        help="where the stage trains: auto (the GPU when one is visible, else the CPU), cpu, cuda or cuda:N (env ANCHORMESH_DEVICE)",
    )
    peer.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the peer keeps its files: shard checkpoints (checkpoints/RUN/stageK/, every checkpoint.every steps and when it leaves; resumed from on restart), on the last stage metrics.jsonl (loss per step), on stage 0 the run's data shards it was given (data/, a few at a time) and windows.log (the window ids it trained)",
    )
    peer.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="stage 0: a folder of the run's prepared shards (from `anchormesh data prepare`) to use instead of downloading them; only files named in the run's manifest whose sha256 matches are read, and none whose real path leaves the folder",
    )
    peer.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="leave once the stage reaches this run step (the run's numbering, not steps since this peer started)",
    )
    peer.add_argument(
        "--threads",
        type=int,
        default=None,  # $ANCHORMESH_THREADS, checked after parsing (peer/cli/environ.py)
        help="torch CPU threads for this peer (default: $ANCHORMESH_THREADS, else 1, so many peers can share one machine; a dedicated CPU peer wants its core count)",
    )
    peer.add_argument(
        "--token",
        default=env("ANCHORMESH_TOKEN") or None,
        help='the run token (the "token" in the bootstrap\'s bootstrap.json), or @FILE to read it from a bootstrap.json or a file holding it; default: $ANCHORMESH_TOKEN',
    )
    peer.add_argument(
        "--tls-ca",
        default=env("ANCHORMESH_TLS_CA") or None,
        help='the run\'s CA certificate when it uses TLS (security.tls): a PEM file, or the bootstrap.json (its "tls_ca"); default: $ANCHORMESH_TLS_CA',
    )
    peer.add_argument(
        "--tracker-key",
        default=env("ANCHORMESH_TRACKER_KEY") or None,
        help='the tracker\'s public key (the "tracker_key" of bootstrap.json, hex, or @bootstrap.json): a peer that finds the tracker through the DHT takes only a record signed with it; default: $ANCHORMESH_TRACKER_KEY, else the key of --tracker HOST:PORT#KEY or of the bootstrap.json that --token @FILE names. A peer off loopback without it refuses to start',
    )
    peer.add_argument(
        "--insecure-plaintext",
        action="store_true",
        default=bool(env("ANCHORMESH_INSECURE_PLAINTEXT")),
        help="UNSAFE: join a run whose bootstrap runs with --insecure-plaintext (no TLS off loopback); default: $ANCHORMESH_INSECURE_PLAINTEXT",
    )
