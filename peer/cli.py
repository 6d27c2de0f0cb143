"""`anchormesh` console entry point: `bootstrap`, `peer`, `config`, `status`, `health`, `demo`, `export`, `bench quality|swarm-quality|boundary|throughput|mixed|project|profile|gpu|plot`.

Bad flags exit with code 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from peer.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="anchormesh", description="Peer-to-peer pipeline training over slow links.")
    sub = p.add_subparsers(dest="command", required=True)

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
        default=os.environ.get("ANCHORMESH_TOKEN") or None,
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

    peer = sub.add_parser("peer", help="join a run and serve a stage")
    env = os.environ.get
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
        default=os.environ.get("ANCHORMESH_DEVICE", "auto"),
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
        default=int(env("ANCHORMESH_THREADS", "1") or 1),
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

    status = sub.add_parser("status", help="show a run's stages, peers, loss and throughput")
    status.add_argument(
        "--tracker",
        required=True,
        help="tracker host:port, or the address line HOST:PORT#KEY (then a run with TLS needs no --tls-ca)",
    )
    status.add_argument("--json", action="store_true", help="one JSON object (see README)")
    status.add_argument("--watch", action="store_true", help="keep updating")
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
        default=os.environ.get("ANCHORMESH_TLS_CA") or None,
        help="the run's CA certificate when it uses TLS (PEM file or bootstrap.json); default: $ANCHORMESH_TLS_CA",
    )

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
        default=os.environ.get("ANCHORMESH_TOKEN") or None,
        help="with --tracker: the run token, or @FILE (a bootstrap.json); default: $ANCHORMESH_TOKEN",
    )
    export.add_argument(
        "--tls-ca",
        default=os.environ.get("ANCHORMESH_TLS_CA") or None,
        help="with --tracker, when the run uses TLS: its CA certificate (PEM file or bootstrap.json); default: $ANCHORMESH_TLS_CA",
    )

    # the benchmarks' package: only this entry point imports it (tests/test_layout.py)
    from peer.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from peer.dataset.cli import add_data_parser

    add_data_parser(sub)
    from peer.doctor.run import add_doctor_parser

    add_doctor_parser(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    from peer.daemon.orphans import install as install_orphan_guard
    from peer.security.auth import read_token
    from peer.security.tls import read_ca

    args = _parser().parse_args(argv)
    install_orphan_guard()  # before any child starts: hivemind's processes and p2pd die with this one
    try:
        if args.command == "demo":
            if not args.local:
                from peer.demo.swarm import run_swarm_demo

                if args.peers < 1:
                    raise ConfigError("--peers", args.peers, "must be >= 1")
                summary = run_swarm_demo(
                    seconds=args.seconds or (600.0 if args.model else 180.0), peers=args.peers, model=args.model
                )
                if summary["startup_s"] is None or summary["processes_left"]:
                    sys.exit(1)
                return
            from peer.demo.local import run_demo

            run_demo(
                seconds=args.seconds or 60.0,
                stages=args.stages,
                codec=args.codec,
                drop=args.drop,
                rank=args.rank,
                threads=args.threads,
            )
        elif args.command == "config":
            from bootstrap.prepare import prepare_run
            from peer.client.run_config import render_json, render_toml
            from peer.runtoml import load_run

            resolved = load_run(args.config, args.set)
            if args.action == "show":
                print(render_json(resolved) if args.json else render_toml(resolved), end="" if not args.json else "\n")
            else:
                cfg = prepare_run(resolved.config)
                print(
                    f"ok: run config {resolved.digest}: model {cfg.model.name} ({cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}), {cfg.model.num_stages} stages, codec {cfg.mask.scheme}"
                )
        elif args.command == "bootstrap":
            from bootstrap.node import run_bootstrap
            from peer.runtoml import load_run

            config = load_run(args.config, args.set).config if (args.config or args.set) else None
            run_bootstrap(
                config,
                args.host,
                args.port,
                args.dht_port,
                args.state_dir,
                args.peer_timeout,
                metrics_port=args.metrics_port,
                announce_host=args.announce_host,
                new_run=args.new_run,
                token=read_token(args.token),
                insecure_plaintext=args.insecure_plaintext,
                public_status=args.public_status,
                dial_back=not args.no_dial_back,
            )
        elif args.command == "peer":
            import faulthandler
            import signal

            print(
                f"anchormesh peer: starting (pid {os.getpid()}); SIGUSR1 dumps every thread's stack to stderr",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            from peer.address import AUTO, outward_address
            from peer.daemon.main import run_peer
            from peer.model.placement import parse_device
            from peer.security.exposure import resolve_access, split_address

            parse_device(args.device)  # no GPU, an index out of range: exit 2 now, before any process starts

            if args.host in ("0.0.0.0", "::") and not args.announce_host:
                raise ConfigError(
                    "--announce-host", None, f"required with --host {args.host}: other peers cannot dial {args.host}"
                )
            if args.threads < 1:
                raise ConfigError("--threads", args.threads, "must be >= 1")
            for flag in ("grpc_port", "dht_port", "metrics_port"):
                if getattr(args, flag) is not None and not 0 <= getattr(args, flag) <= 65535:
                    raise ConfigError(
                        f"--{flag.replace('_', '-')}", getattr(args, flag), "must be a port number in [0, 65535]"
                    )
            announce = args.announce_host
            if announce == AUTO:
                if not (args.tracker or args.initial_peers):
                    raise ConfigError(
                        "--announce-host", AUTO, "needs --tracker or --initial-peers to find the route out"
                    )
                try:
                    announce = outward_address(
                        split_address(args.tracker)[0] if args.tracker else args.initial_peers[0]
                    )
                except ValueError as exc:
                    raise ConfigError("--announce-host", AUTO, str(exc)) from None
                print(f"anchormesh peer: --announce-host auto: {announce}", file=sys.stderr, flush=True)
            # off loopback: the tracker's key is required, and TLS is on unless --insecure-plaintext
            access = resolve_access(
                args.tracker,
                args.initial_peers,
                args.tracker_key,
                args.token,
                args.tls_ca,
                args.insecure_plaintext,
                require=True,
            )
            run_peer(
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
                token=read_token(args.token),
                tls_ca=access.ca,
                tracker_key=access.key,
                data_dir=args.data_dir,
                fetch_tls=access.fetch,
            )
        elif args.command == "export":
            from peer.client.export import run_export

            if not args.timeout > 0:
                raise ConfigError("--timeout", args.timeout, "must be > 0")
            if args.run and not args.checkpoints:
                raise ConfigError("--run", args.run, "only goes with --checkpoints")
            from peer.security.exposure import client_ca, resolve_access

            access = (
                resolve_access(args.tracker, [], None, args.token, args.tls_ca, False) if args.tracker else None
            )  # the address line works here too
            tls_ca = client_ca(access) if access else read_ca(args.tls_ca)
            raise SystemExit(
                run_export(
                    access.tracker if access else None,
                    args.out,
                    args.timeout,
                    checkpoints=args.checkpoints,
                    run_id=args.run,
                    token=read_token(args.token),
                    tls_ca=tls_ca,
                )
            )
        elif args.command == "status":
            from peer.client.status import run_status
            from peer.security.exposure import client_ca, resolve_access

            access = resolve_access(args.tracker, [], None, args.token, args.tls_ca, False)
            run_status(access.tracker, args.json, args.watch, token=read_token(args.token), tls_ca=client_ca(access))
        elif args.command == "ban":
            from peer.client.ban import run_ban

            raise SystemExit(run_ban(args.bootstrap, args.peer, args.reason, args.unban))
        elif args.command == "health":
            from peer.client.health import run_health

            if not args.timeout > 0:
                raise ConfigError("--timeout", args.timeout, "must be > 0")
            raise SystemExit(run_health(args.address, args.tracker, args.timeout, read_ca(args.tls_ca)))
        elif args.command == "doctor":
            from peer.doctor.run import run_doctor

            raise SystemExit(run_doctor(args))
        elif args.command == "data":
            from peer.dataset.cli import run_data

            run_data(args)
        elif args.command == "bench":
            from peer.bench.cli import run_bench

            run_bench(args)
    except ConfigError as exc:
        print(f"anchormesh: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("anchormesh: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
