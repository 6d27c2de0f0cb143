"""`anchormesh` console entry point: sub-commands `demo` and `bench quality`.

The swarm sub-commands (`bootstrap`, `peer`, `status`) arrive with the networked swarm.
Bad flags exit with code 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peer.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="anchormesh", description="Peer-to-peer pipeline training over slow links.")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train the tiny default model in local pipeline stages and show progress")
    demo.add_argument("--seconds", type=float, default=60.0, help="training time budget (default 60)")
    demo.add_argument("--stages", type=int, default=2)
    demo.add_argument("--codec", choices=("lowrank", "mask"), default="lowrank", help="PP link codec (default lowrank)")
    demo.add_argument("--drop", type=float, default=0.95, help="with --codec mask: P(drop) of activation entries")
    demo.add_argument("--rank", type=int, default=20, help="with --codec lowrank: coefficients per token")
    demo.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")

    bench = sub.add_parser("bench", help="benchmarks (JSON out)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    q = bsub.add_parser("quality", help="eval loss of dense vs masked vs masked+anchor (+DP) adaptation")
    q.add_argument("--quick", action="store_true", help="small setup that ends within 5 minutes on 2 CPU cores")
    q.add_argument("--corpus-a", help="general corpus (file or folder of text); default: found on this machine")
    q.add_argument("--corpus-b", help="domain corpus (file or folder of text); default: found on this machine")
    q.add_argument("--rows", help="comma-separated subset of rows to run")
    q.add_argument("--json", required=True, type=Path, help="write the result here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.command == "demo":
            from peer.demo import run_demo

            run_demo(seconds=args.seconds, stages=args.stages, codec=args.codec, drop=args.drop, rank=args.rank, threads=args.threads)
        elif args.command == "bench" and args.bench == "quality":
            from peer.bench.quality import run_quality

            only = [r.strip() for r in args.rows.split(",")] if args.rows else None
            result = run_quality(args.quick, args.corpus_a, args.corpus_b, only)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))
            print(f"wrote {args.json}")
    except ConfigError as exc:
        print(f"anchormesh: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("anchormesh: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
