"""The flags of the benches that run on the namespace bed (`bench throughput`, `bench mixed`),
and the swarm's shape every bench that builds or models a swarm shares (peer/bench/parser.py).

Why a module of its own: the bed's benches carry the most flags; apart, each parser module stays
short enough to read.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def swarm_shape(p: argparse.ArgumentParser) -> None:
    """The swarm's shape, the same flags for every bench that builds or models one."""
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="peers per stage (default 2)")


def add_bed_parsers(bsub: argparse._SubParsersAction) -> None:
    """`bench throughput` and `bench mixed` on the bench subcommand's parsers."""
    t = bsub.add_parser(
        "throughput",
        help="tokens/s of dense vs masked vs masked+DP vs compute-bound on shaped links (network namespaces; root)",
    )
    t.add_argument("--quick", action="store_true", help="short runs that end within 8 minutes on 2 CPU cores")
    t.add_argument(
        "--bandwidth-mbit",
        type=float,
        default=None,
        help="link speed of every host (default: the GPU-equivalent of 200 Mbit/s, see docs/benchmarks.md)",
    )
    swarm_shape(t)
    t.add_argument(
        "--modes", help="comma-separated subset of compute_bound,dense,masked,masked_dp,dense_sync (default: all)"
    )
    t.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="measure every mode this many times, interleaved (A B C D A B C D ...); medians and spreads in OUT (default 3; 1 with --quick)",
    )
    t.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="pipeline.max_staleness of the swarm's modes: steps stage 0 may run ahead of its applied gradients (default 0: the pipeline drains every step; the recommended run's is 1)",
    )
    t.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measure the swarm's modes until this run step (default 100; 30 with --quick): a longer window averages over more averaging rounds",
    )
    t.add_argument(
        "--dp-like",
        default=None,
        metavar="MODEL",
        help="shape the data-parallel traffic as MODEL's would stand to its compute (llama-3.2-1b, llama-3.1-8b, "
        "or another model `bench project` knows): each peer's traffic to and from its stage mates (averaging; "
        "dense_sync's all-reduce) on a slower class of its own link, by (DP / PP bytes)_tiny / (DP / PP bytes)_MODEL "
        "per stage, the GPU scenario in MODEL's shape; the rates and formula in OUT's setup (peer/bench/dp_shape.py)",
    )
    t.add_argument("--out", required=True, type=Path, help="write the result (JSON) to this file")
    mx = bsub.add_parser(
        "mixed",
        help="one swarm on two link speeds at once: codec fixed vs self-tuning, against compute-bound (network namespaces; root)",
    )
    mx.add_argument(
        "--quick",
        action="store_true",
        help="short runs (each peer warms up 10 steps, then 90 run steps measured per mode; about 7 minutes on 2 CPU cores)",
    )
    mx.add_argument(
        "--bandwidth-mbit",
        type=float,
        default=None,
        help="the fast links' speed (default: the GPU-equivalent of 200 Mbit/s)",
    )
    mx.add_argument(
        "--slow-factor",
        type=float,
        default=8.0,
        help="how many times slower the second peer of each stage group is linked (default 8)",
    )
    mx.add_argument(
        "--codec",
        default="transform",
        help="the PP codec: transform (the swarm's, default) or lowrank (rank 64, the first runs')",
    )
    mx.add_argument(
        "--grad-min-bits",
        type=float,
        default=1.0,
        help="transform: the fewest bits per value an adapting link sends gradients with (mask.grad_min_bits; default 1: they do not adapt)",
    )
    mx.add_argument(
        "--max-staleness",
        type=int,
        default=1,
        help="pipeline.max_staleness: steps stage 0 may run ahead of its applied gradients (default 1, the recommended run's)",
    )
    mx.add_argument(
        "--drop",
        action="store_true",
        help="then one more run, every link fast, where the last stage's second peer's link falls to a tenth mid-run: "
        "tokens/s before, settled after, and the seconds to settle (OUT's drop; about 2.5 more minutes)",
    )
    swarm_shape(mx)
    mx.add_argument("--out", required=True, type=Path, help="write the result (JSON) to this file")
