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
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from bootstrap.data_order import DataOrder
from peer.bench.proc_memory import release_memory, rss_gb, tree_pss_gb
from peer.bench.quality import DEFAULT_ROW, setup_for
from peer.bench.quality_rows import QualitySetup, rows
from peer.bench.quality_train import run_row
from peer.config import TINY_MODEL_PREFIX, PipelineConfig
from peer.dataset.shards import PreparedData
from peer.errors import ConfigError
from peer.model.stages import StageModule, split_model
from peer.pipeline.local import evaluate_stages

# the in-process rows the swarms are read against: the synchronous pair, and the pair with two
# replicas per stage averaged every 10 steps (the swarm's shape)
IN_PROCESS_ROWS = ("dense", DEFAULT_ROW, "dense_dp", "transform_dp")
SWARMS = ("dense", "recommended")
# the dense swarm: only its links differ from the recommended run
DENSE_LINKS = {"codec": {"scheme": "mask", "mask": {"drop": 0.0}}}
# glibc's arenas: at its default (8 per core) four SmolLM2 peers and this process outgrew 24 GB
PEER_ENV = {"MALLOC_ARENA_MAX": "2"}
CORPUS_BYTES = 3_000_000  # text prepared per task: ~900 k tokens of Python with SmolLM2's tokenizer, ~150 files
HELDOUT_FRACTION = 0.08  # of the documents, each for the eval and the confirmation split: ~12 whole files each


def default_source(task: str) -> str:
    """The text each task trains on when `--corpus` is not given: this Python's standard library
    (Python source: the adaptation domain), or the licence texts (general prose)."""
    if task == "adapt":
        return str(Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}")
    return "/usr/share/common-licenses"


def tokenizer_of(model: str) -> str:
    """What `data prepare` calls the model's tokenizer: bytes for the tiny models (as their runs read)."""
    return "bytes" if model.startswith(TINY_MODEL_PREFIX) else model


def prepare_data(folder: Path, model: str, source: str, seq_len: int) -> PreparedData:
    """The corpus tokenized once with the model's tokenizer: eval and confirmation documents held out."""
    from peer.dataset.prepare import prepare

    prepare(
        source,
        tokenizer_of(model),
        folder,
        force=True,
        max_bytes=CORPUS_BYTES,
        show_progress=False,
        eval_fraction=HELDOUT_FRACTION,
        confirm_fraction=HELDOUT_FRACTION,
        min_heldout_tokens=16 * (seq_len + 1),
    )
    return PreparedData(folder, tokenizer=tokenizer_of(model))


def window_batches(data: PreparedData, setup: QualitySetup) -> Callable[..., torch.Tensor]:
    """`run_row`'s batch function over the prepared training windows: micro-batch j of step s
    (in the synchronous rows' numbering, which the DP rows share) takes the next `bs` windows of
    one seeded permutation, so every row trains on the same windows, each at most once; anchor
    passes (replica 99) read from the permutation's far end. The permutation is the tracker's
    first epoch (bootstrap/data_order.py), so the rows train on the windows the swarms train on."""
    windows = data.windows(setup.seq_len)
    order = DataOrder(windows.count, setup.seq_len, seed=setup.seed).permutation(0)
    m = setup.micro_batches

    def batch(step: int, replica: int, j: int, *, bs: int, T: int) -> torch.Tensor:
        if T != setup.seq_len:
            raise ValueError(f"seq_len {T}: the prepared windows are {setup.seq_len} tokens")
        first = (step * m + j) * bs if replica != 99 else windows.count - (step * m + j + 1) * bs
        if not 0 <= first <= windows.count - bs:
            raise ValueError(f"the prepared data holds {windows.count} windows; step {step} needs more")
        return torch.from_numpy(windows.batch([int(i) for i in order[first : first + bs]]))

    return batch


def swarm_toml(model: str, setup: QualitySetup, data: Path, replicas: int, swarm: str) -> str:
    """The swarm's run.toml: the model in 2 stages, the rows' sizes, the prepared data, the token
    budget; the codec and everything else are the defaults (the recommended run), except the
    dense swarm's links."""
    if setup.micro_batches % replicas:
        raise ConfigError("--replicas", replicas, f"must divide the rows' {setup.micro_batches} micro-batches per step")
    tiny = model.startswith(TINY_MODEL_PREFIX)
    budget = setup.adapt_steps * setup.micro_batches * setup.micro_batch_size * setup.seq_len
    sections: dict[str, dict] = {
        "model": {
            "name": model,
            "num_stages": setup.model.num_stages,
            "max_seq_len": max(setup.seq_len, setup.model.max_seq_len if tiny else 64),
            **(
                {
                    "hidden_size": setup.model.hidden_size,
                    "num_layers": setup.model.num_layers,
                    "num_heads": setup.model.num_heads,
                }
                if tiny
                else {}
            ),
        },
        "optim": {"lr": setup.adapt_lr},
        "pipeline": {
            "micro_batch_size": setup.micro_batch_size,
            "micro_batches": setup.micro_batches // replicas,
            "seq_len": setup.seq_len,
        },
        "data": {"prepared": str(data)},
        # only the exit checkpoint (the weights scored), and no replica of another stage's state:
        # a durability feature that holds that state (0.8 GB for SmolLM2's stage 1) and pulls it
        # mid-run; with it four SmolLM2 peers and this process outgrew a 24 GB machine
        "checkpoint": {"every": 10_000, "replicate_every_s": 0.0},
        "codec": {"seed": setup.seed, **(DENSE_LINKS["codec"] if swarm == "dense" else {})},
    }
    lines = [f"seed = {setup.seed}", f"token_budget = {budget}"]
    for name, values in sections.items():
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, dict)]
        for sub, kv in nested.items():
            lines.append(f"[{name}.{sub}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in kv.items()]
    return "\n".join(lines) + "\n"


def run_swarm(work: Path, toml: str, peers: int, timeout_s: float, budget: int = 0) -> dict:
    """Start the bootstrap and `peers` peers on `toml`, wait until the tracker stops the run at
    its token budget and every peer has left, and return the tracker's last status and timings.
    Every process started is stopped, by pid, whatever happens."""
    import grpc

    from peer.client.status import status_dict
    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap
    from peer.security.auth import Credentials, tracker_channel
    from peer.wire import anchormesh_pb2 as pb
    from peer.wire import anchormesh_pb2_grpc as pbg

    work.mkdir(parents=True, exist_ok=True)
    (work / "run.toml").write_text(toml)
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    last, first_step, done = None, None, None
    peak: dict[int, float] = {}  # process -> the most resident memory seen, GB (a peer killed for memory shows here)
    peak_tree: dict[int, float] = {}  # process -> the most Pss of it and its children (averaging process, p2pd), GB
    try:
        procs.append(
            start_process(
                ["bootstrap", "--config", str(work / "run.toml"), "--state-dir", str(work / "boot")], work / "boot.log"
            )
        )
        info = wait_for_bootstrap(work / "boot", procs[0], work / "boot.log", timeout_s=300)
        for i in range(peers):
            args = [
                "peer",
                "--tracker",
                info["tracker"],
                "--token",
                f"@{work}/boot/bootstrap.json",
                "--state-dir",
                str(work / f"p{i}"),
            ]
            procs.append(start_process(args, work / f"p{i}.log", **PEER_ENV))
        with tracker_channel(info["tracker"], Credentials(token=info["token"])) as channel:
            stub = pbg.StatusStub(channel)
            shown = 0.0
            while True:
                now = time.monotonic()
                for k, proc in enumerate(procs):
                    peak[k] = max(peak.get(k, 0.0), rss_gb(proc.pid) or 0.0)
                    peak_tree[k] = max(peak_tree.get(k, 0.0), tree_pss_gb(proc.pid) or 0.0)
                try:
                    last = stub.GetStatus(pb.StatusRequest(), timeout=10)
                except grpc.RpcError as exc:
                    print(f"  status: {exc.code().name}", flush=True)
                if last is not None and first_step is None and last.step > 0:
                    first_step = now
                peers_left = all(p.poll() is not None for p in procs[1:])
                if peers_left:
                    done = now
                    break
                if now - t0 > timeout_s:
                    raise RuntimeError(f"the swarm did not finish within {timeout_s:.0f} s (logs in {work})")
                if last is not None and now - shown >= 30:
                    shown = now
                    rate = last.tokens / (now - first_step) if first_step and now > first_step else 0.0
                    eta = f", ETA {(budget - last.tokens) / rate:.0f} s" if budget and rate else ""
                    loss = f", loss {last.loss:.3f}" if last.loss == last.loss and last.step else ""
                    print(
                        f"  step {last.step}, {last.tokens} tokens{loss}, {rate:.0f} tokens/s{eta} ({now - t0:.0f} s since launch)",
                        flush=True,
                    )
                time.sleep(2.0)
    finally:
        stop_processes(procs)
    if last is None:
        raise RuntimeError(f"the tracker never answered (logs in {work})")
    s = status_dict(last)
    return {
        "status": {
            k: s.get(k)
            for k in (
                "state",
                "reason",
                "step",
                "tokens",
                "loss",
                "pp_bytes_per_token",
                "pp_state_bytes_per_token",
                "dp_bytes_per_token",
                "anchor_bytes_per_token",
                "config_digest",
            )
        },
        # per peer, from its own counters: where the bytes went, and what the link tuner chose
        "peers": [
            {
                k: p.get(k)
                for k in (
                    "id",
                    "stage",
                    "state",
                    "step",
                    "bytes_in",
                    "bytes_out",
                    "anchor_bytes_out",
                    "pp_state_bytes_out",
                    "dp_bytes_out",
                    "link_mbit",
                    "pp_keep",
                    "reason",
                )
            }
            for p in s.get("peers", [])
        ],
        "seconds": done - t0 if done else None,
        "startup_s": first_step - t0 if first_step else None,
        "train_seconds": done - first_step if done and first_step else None,
        "peak_rss_gb": {("bootstrap" if k == 0 else f"p{k - 1}"): round(v, 2) for k, v in peak.items()},
        "peak_tree_pss_gb": {("bootstrap" if k == 0 else f"p{k - 1}"): round(v, 2) for k, v in peak_tree.items()},
        "exit_codes": {f"p{k - 1}": p.returncode for k, p in enumerate(procs) if k},
    }


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
