"""`dense_sync` on the namespace bed: what a user would run instead of the swarm, measured.

Stock synchronous pipeline + data parallelism, written with torch.distributed (gloo over TCP, one
process per bed host, rank = stage * replicas + replica), on the same bed, links, tiny model,
micro-batches and optimizer as the swarm's modes (peer/bench/throughput.py):
  - GPipe: each replica's stage 0 runs its M forwards, sending each micro-batch's fp16
    activations to the next stage, which returns fp16 gradients; the pipeline is flushed (every
    backward done) before the step;
  - then a dense fp32 all-reduce of the gradients in each stage group (gloo), the mean, and
    AdamW on every replica: the replicas stay identical, as with DDP.
Nothing overlaps: no activation of step n+1 leaves before step n's all-reduce. That is the
baseline the research reports its 9x / 40x against, and what `bench project` simulates as
`dense_sync`.

Run by `measure_sync` (one process per host, inside the bed); rank 0 writes the result JSON.
Tokens come from a seeded generator both ends of a pipeline share (throughput only: the loss of
random tokens says nothing, so no eval loss is reported).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from pathlib import Path

from peer.errors import ConfigError

PORT = 29517


def _batch(step: int, replica: int, j: int, bs: int, T: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(((step * 131 + replica) * 257 + j) & 0x7FFFFFFF)
    return torch.randint(0, vocab, (bs, T + 1), generator=g)


def run_rank(args: argparse.Namespace) -> None:
    """One rank's training loop (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from peer.model.loading import load_causal_lm
    from peer.model.stages import lm_loss, split_model
    from peer.runtoml import config_from_dict

    torch.set_num_threads(args.threads)
    cfg = config_from_dict(json.loads(Path(args.config).read_text()))
    K, R = cfg.model.num_stages, args.replicas
    stage_i, replica = divmod(args.rank, R)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{PORT}",
        rank=args.rank,
        world_size=K * R,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    groups = [dist.new_group([s * R + j for j in range(R)]) for s in range(K)]  # every rank makes every group, in order
    stage = split_model(load_causal_lm(cfg.model, seed=cfg.seed), K)[stage_i]  # the same weights on every replica
    stage.train()
    params = [p for p in stage.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), weight_decay=cfg.optim.weight_decay
    )
    p = cfg.pipeline
    B, T, M, H, V = p.micro_batch_size, p.seq_len, p.micro_batches, stage.hidden_size, stage.vocab_size
    prev, nxt = (stage_i - 1) * R + replica, (stage_i + 1) * R + replica
    times: list[float] = []
    losses: list[float] = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        saved = []
        for j in range(M):  # GPipe: every forward, then every backward
            window = _batch(step, replica, j, B, T, V)
            if stage.is_first:
                x = None
                out = stage(window[:, :-1])
            else:
                buf = torch.empty(B, T, H, dtype=torch.float16)
                dist.recv(buf, src=prev)
                x = buf.float().requires_grad_(True)
                out = stage(x)
            if stage.is_last:
                loss = lm_loss(out, window[:, 1:]) / M
                losses.append(float(loss) * M)
                saved.append((x, loss))
            else:
                dist.send(out.detach().to(torch.float16), dst=nxt)
                saved.append((x, out))
        for x, out in reversed(saved):
            if stage.is_last:
                out.backward()
            else:
                g = torch.empty(B, T, H, dtype=torch.float16)
                dist.recv(g, src=nxt)
                out.backward(g.float())
            if x is not None:
                dist.send(x.grad.to(torch.float16), dst=prev)
        flat = torch.cat([q.grad.reshape(-1) for q in params])  # one fp32 all-reduce per stage group
        dist.all_reduce(flat, group=groups[stage_i])
        flat /= R
        at = 0
        for q in params:
            q.grad.copy_(flat[at : at + q.numel()].view_as(q))
            at += q.numel()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        dist.barrier()  # the step ends together everywhere: rank 0's clock is the run's
        times.append(time.perf_counter() - t0)
        if args.rank == 0 and step % 5 == 0:
            print(f"step {step}: {times[-1]:.2f}s", flush=True)
    # each replica's weights after the run: the all-reduce keeps a stage group's identical
    Path(f"{args.out}.rank{args.rank}").write_text(
        json.dumps(
            {
                "stage": stage_i,
                "replica": replica,
                "weights_sum": float(sum(q.detach().double().sum() for q in params)),
                "weights_abs_sum": float(sum(q.detach().double().abs().sum() for q in params)),
                "last_loss": losses[-1] if losses else None,
            }
        )
    )
    if args.rank == 0:
        measured = sum(times[args.warmup :])
        tokens = args.steps * R * M * B * T
        Path(args.out).write_text(
            json.dumps(
                {
                    "tokens_per_s": tokens / measured,
                    "tokens_measured": tokens,
                    "seconds_measured": measured,
                    "step_s": times[args.warmup :],
                }
            )
        )
    if losses and replica == 0:
        print(f"last loss {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()


def measure_sync(
    config: dict,
    rate_mbit: float | None,
    stages: int,
    replicas: int,
    warmup: int,
    steps: int,
    workdir: Path,
    subnet: int,
    timeout_s: float,
    dp_rates_mbit: list[float] | None = None,
) -> dict:
    """Run the baseline on a fresh bed of `stages * replicas` hosts (every link at `rate_mbit`;
    with `dp_rates_mbit`, one per stage, a rank's traffic to and from its stage mates at its
    stage's rate: peer/bench/dp_shape.py) and return its tokens/s and the bytes that crossed the links."""
    import sys

    from peer.bench.netbed import NetBed

    n = stages * replicas
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path, out_path = workdir / "dense_sync.json", workdir / "dense_sync.out.json"
    cfg_path.write_text(json.dumps(config))
    for old in (out_path, *(Path(f"{out_path}.rank{i}") for i in range(n))):
        old.unlink(missing_ok=True)
    t_start = time.monotonic()
    print(
        f"[dense_sync] {n} ranks (gloo), links {f'{rate_mbit:.2f} Mbit/s' if rate_mbit else 'unshaped'}; warm-up {warmup} steps, measure {steps}",
        flush=True,
    )
    with NetBed([rate_mbit] * n, subnet=subnet) as bed:
        if dp_rates_mbit is not None:
            from peer.bench.dp_shape import shape_groups, sync_groups

            shape_groups(bed, sync_groups(stages, replicas), rate_mbit, dp_rates_mbit)
        master = bed.hosts[0].address
        procs = []
        for rank in range(n):
            argv = [
                sys.executable,
                "-m",
                "peer.bench.sync_baseline",
                "--rank",
                str(rank),
                "--replicas",
                str(replicas),
                "--master",
                master,
                "--config",
                str(cfg_path),
                "--warmup",
                str(warmup),
                "--steps",
                str(steps),
                "--out",
                str(out_path),
                "--timeout-s",
                str(timeout_s),
            ]
            procs.append(
                bed.popen(
                    rank, argv, workdir / f"rank{rank}.log", env={"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
                )
            )
        c0 = bed.counters()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"dense_sync did not finish within {timeout_s:.0f}s (logs in {workdir})")
            time.sleep(0.5)
        c1 = bed.counters()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
    if bad or not out_path.exists():
        tail = (workdir / f"rank{bad[0][0] if bad else 0}.log").read_text()[-2000:]
        raise RuntimeError(f"dense_sync rank(s) failed {bad}: {tail}")
    got = json.loads(out_path.read_text())
    ranks = [json.loads(Path(f"{out_path}.rank{i}").read_text()) for i in range(n)]
    total_tokens = (warmup + steps) * got["tokens_measured"] / steps
    wire = sum(c1[i][0] - c0[i][0] for i in c1)
    result = {
        "tokens_per_s": got["tokens_per_s"],
        "wire_bytes_per_token": wire / total_tokens,  # the whole run (warm-up included): the same bytes every step
        "eval_loss": None,
        "rate_mbit": rate_mbit,
        "dp_rates_mbit": dp_rates_mbit,
        "tokens_measured": got["tokens_measured"],
        "seconds_measured": got["seconds_measured"],
        "step_s_median": sorted(got["step_s"])[len(got["step_s"]) // 2],
        "schedule": "GPipe + an fp32 gradient all-reduce per stage group before every step (torch.distributed, gloo)",
        "wall_s": time.monotonic() - t_start,
        "ranks": ranks,
    }
    print(
        f"[dense_sync] {result['tokens_per_s']:,.0f} tok/s, {result['wire_bytes_per_token']:.0f} wire B/token ({result['wall_s']:.0f}s)",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one rank of the dense_sync baseline (run by bench throughput)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or not math.isfinite(args.timeout_s):
        raise ConfigError("--steps", args.steps, "must be >= 1 (and --warmup >= 0)")
    run_rank(args)


if __name__ == "__main__":
    main()
