"""`anchormesh bench swarm-quality`: does the real swarm train as well as the in-process bench says?

`bench quality` runs every stage in one process, one replica per stage, fp32, no stage-group
averaging and no link tuner. The swarm adds all of that. This benchmark runs both on the same
data: the corpus is prepared once (`data prepare`: documents held out, not a tail), the swarm's
bootstrap serves it, the in-process rows draw their windows from its training split, and every
row and both swarms are scored on the same fixed eval windows by a dense forward pass of the
trained stages.

The swarms: a bootstrap and `stages x replicas` peers as processes on loopback, the recommended
run (the config defaults) and the same run with dense links (codec `mask`, nothing dropped), each
stage-0 peer taking `micro_batches / replicas` micro-batches a step so that a step of the group
holds the in-process row's tokens; the run ends at the same token budget (the tracker stops it).
PP bytes per token come from the peers' own wire counters as the tracker adds them up. A swarm's
trained weights are its peers' exit checkpoints; its eval loss is that of the stage groups'
averaged weights (what the next averaging round gives), and of each chain of one peer per stage.

Where the parts live: the corpus prepared and read in swarm_quality_data.py; the swarms' run.toml
and their processes in swarm_quality_run.py; the in-process rows in quality_train.py.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from peer.bench.proc_memory import release_memory, rss_gb
from peer.bench.quality import DEFAULT_ROW, setup_for
from peer.bench.quality_rows import rows
from peer.bench.quality_train import run_row
from peer.bench.swarm_quality_data import default_source, prepare_data, window_batches
from peer.bench.swarm_quality_run import PEER_ENV, run_swarm, swarm_toml
from peer.config import PipelineConfig
from peer.errors import ConfigError
from peer.model.stages import StageModule, split_model
from peer.pipeline.local import evaluate_stages

# the in-process rows the swarms are read against: the synchronous pair, and the pair with two
# replicas per stage averaged every 10 steps (the swarm's shape)
IN_PROCESS_ROWS = ("dense", DEFAULT_ROW, "dense_dp", "transform_dp")
SWARMS = ("dense", "recommended")


def _load(stage: StageModule, tensors: list[torch.Tensor], where: str) -> None:
    params = list(stage.parameters())
    if len(tensors) < len(params) or any(t.shape != p.shape for t, p in zip(tensors, params)):
        raise RuntimeError(f"{where}: the checkpoint does not fit stage {stage.index}'s parameters")
    with torch.no_grad():
        for p, t in zip(params, tensors):
            p.copy_(t)


def swarm_weights(work: Path, peers: int, num_stages: int) -> dict[int, list[tuple[str, list[torch.Tensor]]]]:
    """Per stage, each peer's exit checkpoint (its parameters): (peer folder, tensors)."""
    from peer.store.checkpoint import ShardCheckpoints, run_dirs

    out: dict[int, list[tuple[str, list[torch.Tensor]]]] = {s: [] for s in range(num_stages)}
    for i in range(peers):
        folder = work / f"p{i}"
        for run_id in run_dirs(folder):
            for s in range(num_stages):
                ck = ShardCheckpoints(folder, run_id, s).newest()
                if ck is not None:
                    n = len(ck.tensors) // 3
                    out[s].append((f"p{i} step {ck.step}", [t.clone() for t in ck.tensors[:n]]))
    missing = [s for s, got in out.items() if not got]
    if missing:
        raise RuntimeError(f"no exit checkpoint of stage(s) {missing} under {work}/p*/checkpoints")
    return out


def evaluate_swarm(
    base: torch.nn.Module,
    weights: dict[int, list[tuple[str, list[torch.Tensor]]]],
    eval_b: list[torch.Tensor],
    chains: bool = True,
) -> dict:
    """Eval loss of the stage groups' averaged weights, and (with `chains`) of every chain of one
    peer per stage: how far the replicas drifted since their last averaging round."""
    stages = split_model(copy.deepcopy(base), len(weights))
    for s, stage in enumerate(stages):
        got = weights[s]
        _load(stage, [torch.stack([w[k] for _, w in got]).mean(0) for k in range(len(got[0][1]))], f"stage {s} average")
    averaged = evaluate_stages(stages, eval_b)
    per_chain = {}
    if chains and len(weights) == 2:
        for name0, w0 in weights[0]:
            for name1, w1 in weights[1]:
                _load(stages[0], w0, name0)
                _load(stages[1], w1, name1)
                per_chain[f"{name0} + {name1}"] = evaluate_stages(stages, eval_b)
    return {
        "eval_loss": averaged,
        "eval_loss_chains": per_chain,
        "peers_per_stage": {s: [n for n, _ in got] for s, got in weights.items()},
    }


def run_swarm_quality(
    model: str,
    work: Path,
    task: str = "adapt",
    seed: int = 0,
    corpus: str | None = None,
    replicas: int = 2,
    steps: int | None = None,
    eval_windows: int = 128,
    swarms: tuple[str, ...] = SWARMS,
    in_process: tuple[str, ...] = IN_PROCESS_ROWS,
    timeout_s: float = 3600.0,
    reuse: dict | None = None,
    seq_len: int | None = PipelineConfig().seq_len,
    chains: bool = False,
) -> dict:
    """The result's JSON (see the module docstring). `steps`: the rows' steps (default: the quick
    setup's 40); `chains`: also score every chain of one peer per stage (a forward pass over the
    eval set each); `eval_windows`: fixed eval windows of the prepared eval split every row is scored
    on; `seq_len`: the windows' length (default: the recommended run's, so that the bytes per
    token are measured at it; None: the quick setup's 64); `reuse`: an earlier result of the same setup whose rows and swarms are kept, not run again
    (the in-process rows do not depend on the machine's load; the swarms are best run alone)."""
    from peer.model.loading import load_causal_lm

    setup = replace(setup_for(True, model), seed=seed)
    if seq_len is not None:  # the same tokens per micro-batch in windows of seq_len
        setup = replace(
            setup, micro_batch_size=max(1, setup.micro_batch_size * setup.seq_len // seq_len), seq_len=seq_len
        )
    if steps is not None:
        setup = replace(setup, adapt_steps=steps)
    table = rows(setup)
    unknown = sorted(set(in_process) - set(table)) + sorted(set(swarms) - set(SWARMS))
    if unknown:
        raise ConfigError(
            "--rows", ",".join(unknown), f"unknown; in-process rows: {', '.join(table)}; swarms: {', '.join(SWARMS)}"
        )
    source = corpus or default_source(task)
    data = prepare_data(work / "data", model, source, setup.seq_len)
    eval_b = [
        torch.from_numpy(w)
        for w in np.array_split(
            data.eval_windows(setup.seq_len, eval_windows), max(1, eval_windows // setup.micro_batch_size)
        )
    ]
    eval_tokens = sum(int(b[:, 1:].numel()) for b in eval_b)
    base = load_causal_lm(setup.model, seed=setup.seed)
    out: dict = {
        "setup": {
            **asdict(setup),
            "task": task,
            "source": source,
            "manifest_tokens": {k: v.tokens for k, v in data.manifest.splits.items()},
            "eval_tokens": eval_tokens,
            "replicas": replicas,
            "peer_env": PEER_ENV,
            "token_budget": setup.adapt_steps * setup.micro_batches * setup.micro_batch_size * setup.seq_len,
            "threads": torch.get_num_threads(),
        },
        "pretrained": {"eval_loss": evaluate_stages(split_model(copy.deepcopy(base), setup.model.num_stages), eval_b)},
        "in_process": {},
        "swarm": {},
    }
    print(f"pretrained eval loss {out['pretrained']['eval_loss']:.4f} on {eval_tokens} held-out tokens", flush=True)
    if reuse is not None:
        mine = json.loads(json.dumps({k: v for k, v in out["setup"].items() if k != "threads"}))  # as the JSON holds it
        same = mine == {k: v for k, v in reuse.get("setup", {}).items() if k != "threads"}
        if not same or abs(reuse.get("pretrained", {}).get("eval_loss", 0.0) - out["pretrained"]["eval_loss"]) > 1e-5:
            raise ConfigError("--reuse", "", "the earlier result was measured on another setup, corpus or eval set")
        out["in_process"], out["swarm"] = dict(reuse.get("in_process", {})), dict(reuse.get("swarm", {}))
    batch = window_batches(data, setup)
    for name in (r for r in in_process if r not in out["in_process"]):
        cfg = replace(
            table[name], mask=replace(table[name].mask, seed=setup.seed)
        )  # the seed draws the codec's randomness too
        r = run_row(
            name,
            cfg,
            lambda: load_causal_lm(setup.model, seed=setup.seed),
            setup,
            None,
            eval_b,
            eval_b[:1],
            batch_fn=batch,
        )
        r.pop("eval_loss_a", None)
        release_memory()
        r["rss_gb_after"] = rss_gb()
        out["in_process"][name] = r
        print(
            f"in-process {name:>18}: eval_loss {r['eval_loss']:.4f}  pp B/token {r['pp_bytes_per_token']:.1f}  {r['seconds']:.0f} s",
            flush=True,
        )
    del base  # the swarms' peers need the memory: reloaded for each swarm's evaluation
    release_memory()
    for name in (r for r in swarms if r not in out["swarm"]):
        print(
            f"swarm {name}: {setup.model.num_stages} stages x {replicas} peers, budget {out['setup']['token_budget']} tokens",
            flush=True,
        )
        r = run_swarm(
            work / f"swarm-{name}",
            swarm_toml(model, setup, data.folder, replicas, name),
            setup.model.num_stages * replicas,
            timeout_s,
            out["setup"]["token_budget"],
        )
        r.update(
            evaluate_swarm(
                load_causal_lm(setup.model, seed=setup.seed),
                swarm_weights(work / f"swarm-{name}", setup.model.num_stages * replicas, setup.model.num_stages),
                eval_b,
                chains,
            )
        )
        release_memory()
        out["swarm"][name] = r
        print(
            f"swarm {name:>18}: eval_loss {r['eval_loss']:.4f}  pp B/token {r['status']['pp_bytes_per_token']:.1f}  {r['seconds']:.0f} s",
            flush=True,
        )
    out["summary"] = summary(out)
    return out


def _gap(rows_: dict, a: str, b: str) -> float | None:
    return rows_[a]["eval_loss"] / rows_[b]["eval_loss"] - 1 if a in rows_ and b in rows_ else None


def summary(out: dict) -> dict:
    """The comparison the benchmark exists for: the swarm's loss gap (recommended over dense) beside
    the in-process gaps, and the swarm's measured PP bytes per token, dense over recommended: in
    all, and the stream alone (without the codec state shipped once per link and version, which a
    run longer than the benchmark's spreads over more tokens)."""
    sw, ip = out["swarm"], out["in_process"]
    bpt = {k: v["status"]["pp_bytes_per_token"] for k, v in sw.items()}
    stream = {
        k: v["status"]["pp_bytes_per_token"] - (v["status"].get("pp_state_bytes_per_token") or 0.0)
        for k, v in sw.items()
    }
    return {
        "swarm_gap": _gap(sw, "recommended", "dense"),
        "in_process_gap": _gap(ip, DEFAULT_ROW, "dense"),
        "in_process_gap_dp": _gap(ip, "transform_dp", "dense_dp"),
        "swarm_pp_bytes_reduction": bpt["dense"] / bpt["recommended"]
        if bpt.get("dense") and bpt.get("recommended")
        else None,
        "in_process_pp_bytes_reduction": ip["dense"]["pp_bytes_per_token"] / ip[DEFAULT_ROW]["pp_bytes_per_token"]
        if "dense" in ip and DEFAULT_ROW in ip
        else None,
        "swarm_pp_stream_reduction": stream["dense"] / stream["recommended"]
        if stream.get("dense") and stream.get("recommended")
        else None,
        "in_process_pp_stream_reduction": ip["dense"]["pp_stream_bytes_per_token"]
        / ip[DEFAULT_ROW]["pp_stream_bytes_per_token"]
        if "dense" in ip and DEFAULT_ROW in ip
        else None,
    }
