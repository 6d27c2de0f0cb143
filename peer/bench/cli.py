"""`anchormesh bench ...`: runs the bench the parsed flags name (peer/bench/parser.py defines
them); the heavy imports happen per bench, after the flags are parsed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peer.errors import ConfigError


def _write(path: Path, result: dict) -> None:
    """A bench's `--out` file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


def run_bench(args: argparse.Namespace) -> None:
    """Runs the bench `args.bench` names; heavy imports happen here, per bench."""
    if args.bench == "quality" and args.gpu_suite:
        from peer.bench.quality_suite import run_gpu_suite

        chosen = {
            "--quick": args.quick,
            "--rows": args.rows,
            "--model": args.model,
            "--steps": args.steps,
            "--tokens-per-step": args.tokens_per_step,
            "--codec-seed": args.codec_seed is not None,
            "--lr": args.lr is not None,
            "--schedule": args.schedule,
            "--task": args.task != "adapt",
        }
        clash = [flag for flag, given in chosen.items() if given]
        if clash:
            raise ConfigError(
                "--gpu-suite", True, f"sets the model, rows, steps and tasks itself: drop {', '.join(clash)}"
            )
        _write(args.out, run_gpu_suite(args.device, args.corpus_a, args.corpus_b, args.seed))
    elif args.bench == "quality":
        from peer.bench.quality import run_quality

        only = [r.strip() for r in args.rows.split(",")] if args.rows else None
        result = run_quality(
            args.quick,
            args.corpus_a,
            args.corpus_b,
            only,
            model=args.model,
            seed=args.seed,
            lr=args.lr,
            schedule=args.schedule,
            device=args.device,
            task=args.task,
            steps=args.steps,
            tokens_per_step=args.tokens_per_step,
            codec_seed=args.codec_seed,
        )
        _write(args.out, result)
    elif args.bench == "swarm-quality":
        import tempfile

        from peer.bench.swarm_quality import IN_PROCESS_ROWS, run_swarm_quality

        def names(value: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
            return default if value is None else tuple(x.strip() for x in value.split(",") if x.strip())

        work = args.work or Path(tempfile.mkdtemp(prefix="anchormesh-swarm-quality-"))
        print(f"prepared data, logs and checkpoints in {work}", flush=True)
        result = run_swarm_quality(
            args.model,
            work,
            task=args.task,
            seed=args.seed,
            corpus=args.corpus,
            replicas=args.replicas,
            steps=args.steps,
            eval_windows=args.eval_windows,
            swarms=names(args.swarms, ()),
            in_process=names(args.rows, IN_PROCESS_ROWS),
            timeout_s=args.timeout,
            chains=args.chains,
            reuse=json.loads(args.reuse.read_text()) if args.reuse else None,
            **({"seq_len": args.seq_len} if args.seq_len else {}),
        )
        _write(args.out, result)
    elif args.bench == "throughput":
        from peer.bench.throughput import main_json

        modes = [m.strip() for m in args.modes.split(",")] if args.modes else None
        main_json(
            args.out,
            quick=args.quick,
            bandwidth_mbit=args.bandwidth_mbit,
            stages=args.stages,
            replicas=args.replicas,
            modes=modes,
            repeat=args.repeat,
            max_staleness=args.max_staleness,
            steps=args.steps,
            dp_like=args.dp_like,
        )
        print(f"wrote {args.out}")
    elif args.bench == "mixed":
        from peer.bench.mixed import main_json as mixed_json

        mixed_json(
            args.out,
            quick=args.quick,
            bandwidth_mbit=args.bandwidth_mbit,
            slow_factor=args.slow_factor,
            stages=args.stages,
            replicas=args.replicas,
            codec=args.codec,
            grad_min_bits=args.grad_min_bits,
            max_staleness=args.max_staleness,
            drop=args.drop,
        )
        print(f"wrote {args.out}")
    elif args.bench == "project":
        from peer.bench.project import main_json as project_json

        project_json(
            args.out,
            model=args.model,
            device=args.gpu,
            bandwidth_mbit=args.bandwidth_mbit,
            stages=args.stages,
            replicas=args.replicas,
            mfu=args.mfu,
            dp_every=args.dp_every,
            shared_cores=args.shared_cores,
            mfu_from=args.mfu_from,
            max_staleness=args.max_staleness,
            link_share=args.link_share,
        )
        if args.out is not None:
            print(f"wrote {args.out}")
    elif args.bench == "profile":
        from peer.bench.profile import main_json as profile_json

        if not args.seconds > 0 or args.dp_every < 1 or not args.bandwidth_mbit > 0 or args.repeat < 1:
            raise ConfigError(
                "--seconds/--dp-every/--bandwidth-mbit/--repeat",
                (args.seconds, args.dp_every, args.bandwidth_mbit, args.repeat),
                "must be > 0",
            )
        profile_json(
            args.out,
            mode=args.mode,
            bandwidth_mbit=args.bandwidth_mbit,
            dp_every=args.dp_every,
            seconds=args.seconds,
            dp_min_period_s=args.dp_min_period_s,
            tls=args.tls,
            repeat=args.repeat,
        )
    elif args.bench == "boundary":
        from peer.bench.boundary import main_json as boundary_json

        if args.eval_tokens < 1 or args.calib_tokens < 1 or args.seq_len < 2:
            raise ConfigError(
                "--eval-tokens/--calib-tokens/--seq-len",
                (args.eval_tokens, args.calib_tokens, args.seq_len),
                "must be >= 1 (seq-len >= 2)",
            )
        rows = [r.strip() for r in args.rows.split(",")] if args.rows else None
        boundary_json(
            args.out,
            model=args.model,
            boundaries=args.boundaries,
            eval_tokens=args.eval_tokens,
            calib_tokens=args.calib_tokens,
            seq_len=args.seq_len,
            quick=args.quick,
            corpus=args.corpus,
            rows=rows,
        )
    elif args.bench == "gpu":
        from peer.bench.gpu import PARTS
        from peer.bench.gpu import main_json as gpu_json

        parts = tuple(x.strip() for x in args.parts.split(",") if x.strip())
        if not parts or set(parts) - set(PARTS):
            raise ConfigError("--parts", args.parts, f"must be a comma-separated subset of {','.join(PARTS)}")
        gpu_json(args.out, args.device, parts, args.quick, args.shape)
        if args.out is not None:
            print(f"wrote {args.out}")
    elif args.bench == "plot":
        from peer.bench.plot import plot

        plot(args.out, measured=args.measured, model=args.model, gpu=args.gpu)
        print(f"wrote {args.out}")
