"""`anchormesh bench ...`: the benchmarks' flags. Only the console entry point (peer/cli/) imports
this package, and only to parse and run a bench: the daemon, the tracker and the client side never
import it (tests/test_layout.py holds that). As everywhere in the command line, a result file is
`--out FILE`; a bench whose `--out` is optional prints its result as JSON on stdout without it."""

from __future__ import annotations

import argparse
from pathlib import Path

from peer.bench.parser_bed import add_bed_parsers, swarm_shape
from peer.config import LR_SCHEDULES


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """The `bench` subcommand and its subcommands, on the entry point's parser."""
    bench = sub.add_parser("bench", help="benchmarks (JSON out)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    q = bsub.add_parser("quality", help="eval loss of dense vs masked vs masked+anchor (+DP) adaptation")
    q.add_argument(
        "--quick",
        action="store_true",
        help="small setup that ends within 5 minutes on 2 CPU cores (about 30 with --model smollm2-135m)",
    )
    q.add_argument(
        "--corpus-a",
        help="general prose: a folder of text files, held out by whole file (default: the Python-docs prose corpus if made, else the licence texts)",
    )
    q.add_argument(
        "--corpus-b",
        help="the domain: a folder of text files, held out by whole file (default: modules of this Python's standard library)",
    )
    q.add_argument(
        "--rows",
        help="comma-separated rows to run, or all; default: all, and with --quick the seven the issue asks for and the default run's (peer/bench/quality.py QUICK_ROWS)",
    )
    q.add_argument(
        "--model",
        default=None,
        help="adapt this pretrained model (hub id, folder, .gguf file, smollm2-135m) instead of the toy pretrained here",
    )
    q.add_argument(
        "--seed",
        type=int,
        default=0,
        help="data order, the codec's draws and the toy's pretraining (the held-out documents stay the same): another seed is a replicate of the same rows (default 0)",
    )
    q.add_argument(
        "--gpu-suite",
        action="store_true",
        help="dense and the recommended row, both tasks, SmolLM2-135M, 20 M tokens a row (about ten minutes on one H100; peer/bench/quality_suite.py); takes --device, --seed, --corpus-a/-b, --out only",
    )
    q.add_argument(
        "--codec-seed",
        type=int,
        default=None,
        help="the codecs' rotations, dither offsets and masks apart from --seed (default: --seed)",
    )
    q.add_argument(
        "--steps", type=int, default=None, help="optimizer steps of every row (default: the setup's, 40 with --quick)"
    )
    q.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        help="tokens per step, micro-batches accumulated as the swarm does (a multiple of micro-batch x sequence length; default: the setup's, 512 with --quick)",
    )
    q.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak adaptation lr of every row (default: the setup's, 1e-4 for a pretrained model)",
    )
    q.add_argument(
        "--schedule",
        choices=LR_SCHEDULES,
        default=None,
        help="lr schedule of every row: constant, or warmup over a tenth of the steps then cosine/linear decay to 0.1 x lr (default: the setup's)",
    )
    q.add_argument(
        "--task",
        default="adapt",
        choices=("adapt", "continual"),
        help="adapt: domain adaptation (train on corpus B, forgetting measured on A); continual: continual pretraining on the general text (the corpora swap roles; needs --model) (default adapt)",
    )
    q.add_argument(
        "--device",
        default="auto",
        help="where the rows train: auto (a visible GPU in bf16, else the CPU in fp32), cpu, cuda or cuda:N (default auto)",
    )
    q.add_argument("--out", required=True, type=Path, help="write the result (JSON) to this file")
    sq = bsub.add_parser(
        "swarm-quality",
        help="the real swarm (bootstrap + stages x replicas peers on loopback) against the in-process quality rows: eval loss, gap, measured PP bytes/token",
    )
    sq.add_argument(
        "--model",
        default="smollm2-135m",
        help="the pretrained model every row and swarm adapts (default smollm2-135m; a tiny-* model for a smoke run)",
    )
    sq.add_argument(
        "--task",
        default="adapt",
        choices=("adapt", "continual"),
        help="adapt: Python source (this Python's standard library); continual: general prose (default adapt)",
    )
    sq.add_argument("--corpus", default=None, help="text file or folder to prepare instead of the task's default")
    sq.add_argument(
        "--seed", type=int, default=0, help="the run's seed: data order, codec draws, the swarm's run seed (default 0)"
    )
    sq.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps of the in-process rows; the swarms get the same token budget (default 40: 20,480 tokens)",
    )
    sq.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per window, micro-batches keeping their tokens (default: the recommended run's pipeline.seq_len, where its bytes per token are measured)",
    )
    sq.add_argument("--replicas", type=int, default=2, help="peers per stage in the swarms (default 2)")
    sq.add_argument(
        "--eval-windows",
        type=int,
        default=128,
        help="fixed eval windows of the prepared eval split every row is scored on (default 128: 16,384 tokens at 128 a window)",
    )
    sq.add_argument(
        "--chains",
        action="store_true",
        help="also score each chain of one peer per stage (one eval pass each): how far the replicas drifted since their last averaging",
    )
    sq.add_argument(
        "--rows",
        default=None,
        help="comma-separated in-process rows (default dense,transform_stale1,dense_dp,transform_dp; empty: none)",
    )
    sq.add_argument(
        "--swarms", default="dense,recommended", help="comma-separated swarms to run: dense, recommended (default both)"
    )
    sq.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder for the prepared data and the swarms' logs and checkpoints (default: a new temporary folder, kept)",
    )
    sq.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="an earlier result of the same setup: its rows and swarms are kept and only the missing ones run (the in-process rows can run beside other work, the swarms alone)",
    )
    sq.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds one swarm may take from launch to its last peer's exit (default 3600)",
    )
    sq.add_argument("--out", required=True, type=Path, help="write the result (JSON) to this file")
    add_bed_parsers(bsub)
    pr = bsub.add_parser(
        "project",
        help="predicted tokens/s of the throughput bench's four modes and of dense_sync (stock pipeline + data parallelism) for a model on a device at a link speed (see peer/bench/project.py)",
    )
    pr.add_argument(
        "--model",
        default="tiny-llama",
        help="run.toml path, local model folder, or tiny-llama / llama-3.2-1b / llama-3.2-3b / llama-3.1-8b / qwen2.5-0.5b / qwen2.5-1.5b (default tiny-llama)",
    )
    pr.add_argument(
        "--gpu",
        required=True,
        help="rtx4090, a100, h100 (published bf16 FLOP/s x --mfu), or cpu (measured on this machine)",
    )
    pr.add_argument("--bandwidth-mbit", type=float, required=True, help="every host's link speed, each way")
    swarm_shape(pr)
    pr.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="fraction of the GPU's peak reached (default: measured by a `bench gpu` run, --mfu-from or docs/results/gpu-bench-DEVICE.json, else 0.40)",
    )
    pr.add_argument(
        "--mfu-from",
        type=Path,
        default=None,
        help="an `anchormesh bench gpu` result on this GPU: its measured bf16 rate sets the MFU",
    )
    pr.add_argument(
        "--dp-every",
        type=int,
        default=10,
        help="steps between DP rounds of masked_dp and compute_bound (default 10, the full bench's)",
    )
    pr.add_argument(
        "--shared-cores",
        type=int,
        default=None,
        help="all peers share this many cores (the namespace test bed); default: each peer its own device",
    )
    pr.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="steps stage 0 may run ahead of its applied gradients (pipeline.max_staleness; default: the run.toml's, else 0: the pipeline drains every step)",
    )
    pr.add_argument(
        "--link-share",
        type=float,
        default=None,
        help="dp.link_share: the most of the link's time a stage group's averaging rounds take (default: the swarm's, 0.2; 0: as often as the link carries them, as `bench throughput` runs its modes)",
    )
    pr.add_argument(
        "--out", type=Path, default=None, help="write the result (JSON) to this file (default: print it on stdout)"
    )
    pf = bsub.add_parser(
        "profile",
        help="CPU per process kind and, with py-spy installed, per part of the peers' main processes, in one mode on the test bed (root)",
    )
    pf.add_argument("--mode", default="masked_dp", help="compute_bound, dense, masked or masked_dp (default masked_dp)")
    pf.add_argument(
        "--bandwidth-mbit",
        type=float,
        default=5.88,
        help="every link's speed (default 5.88: the GPU-equivalent of 200 Mbit/s measured on this box; ignored for compute_bound)",
    )
    pf.add_argument(
        "--dp-every",
        type=int,
        default=5,
        help="steps between DP rounds of masked_dp and compute_bound (default 5, the quick bench's)",
    )
    pf.add_argument("--seconds", type=float, default=25.0, help="length of the profiled window (default 25)")
    pf.add_argument(
        "--dp-min-period-s",
        type=float,
        default=None,
        help="dp.min_period_s of the profiled run (default: the run default); 1 = as often as hivemind allows",
    )
    pf.add_argument(
        "--tls",
        choices=("on", "off", "both"),
        default="on",
        help="on: the bed as a run off loopback is (TLS); off: every process with --insecure-plaintext; both: each window run once with and once without, interleaved, medians side by side (what TLS costs; the other checks are attributed from py-spy's samples)",
    )
    pf.add_argument("--repeat", type=int, default=1, help="windows per TLS setting (default 1; 3 for a median)")
    pf.add_argument(
        "--out", type=Path, default=None, help="write the result (JSON) to this file (default: print it on stdout)"
    )
    bd = bsub.add_parser(
        "boundary",
        help="what each stage-boundary codec does to a pretrained model, forward only: eval loss through the codec, wire bytes/token, activation statistics (see peer/bench/boundary.py)",
    )
    bd.add_argument(
        "--model",
        default="smollm2-135m",
        help="hub id, folder, .gguf file, smollm2-135m or tiny-* (default smollm2-135m)",
    )
    bd.add_argument(
        "--boundaries",
        default=None,
        help="comma-separated layer counts L: the boundary after decoder layer L (default 5,10,15,20,25; --quick: 15)",
    )
    bd.add_argument(
        "--eval-tokens", type=int, default=2048, help="held-out tokens the loss is measured on (default 2048)"
    )
    bd.add_argument(
        "--calib-tokens", type=int, default=8192, help="tokens the codecs are fitted on, never evaluated (default 8192)"
    )
    bd.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    bd.add_argument(
        "--corpus", type=Path, default=None, help="text file or folder (default: the built-in Python corpus)"
    )
    bd.add_argument("--rows", default=None, help="comma-separated subset of codec rows")
    bd.add_argument(
        "--quick",
        action="store_true",
        help="one boundary, a quarter of the tokens, a few rows (minutes on 2 CPU cores)",
    )
    bd.add_argument(
        "--out", type=Path, default=None, help="write the result (JSON) to this file (default: print it on stdout)"
    )
    gp = bsub.add_parser(
        "gpu",
        help="the GPU path end to end: fp32 vs bf16 vs bf16+checkpointing (tokens/s, peak memory vs plan, host syncs), a 2x2 swarm on the device with a SIGKILL, a memory refusal (see peer/bench/gpu.py)",
    )
    gp.add_argument("--device", default="auto", help="auto (the GPU when present), cpu, cuda or cuda:N")
    gp.add_argument(
        "--parts",
        default=",".join(("precision", "swarm", "memory_refusal")),
        help="comma-separated subset of precision,swarm,memory_refusal",
    )
    gp.add_argument(
        "--shape",
        choices=("llama-3.2-1b", "llama-3.2-1b-4l", "small"),
        default=None,
        help="model shape of the precision part (default: llama-3.2-1b on a GPU, small on the CPU; -4l: 4 of its 16 layers)",
    )
    gp.add_argument("--quick", action="store_true", help="fewer measured steps")
    gp.add_argument(
        "--out", type=Path, default=None, help="write the result (JSON) to this file (default: print it on stdout)"
    )
    pl = bsub.add_parser(
        "plot",
        help="tokens/s against bandwidth (25-1000 Mbit/s) of the four modes, projected, with measured points (PNG; needs the [bench] extra)",
    )
    pl.add_argument(
        "--in",
        dest="measured",
        type=Path,
        default=None,
        metavar="RESULT",
        help="a `bench throughput` result (its --out file) to overlay (scaled by its GPU-equivalent rule)",
    )
    pl.add_argument("--out", type=Path, required=True, help="PNG to write")
    pl.add_argument("--model", default="llama-3.2-1b", help="as for `bench project` (default llama-3.2-1b)")
    pl.add_argument("--gpu", default="rtx4090", help="as for `bench project` (default rtx4090)")
