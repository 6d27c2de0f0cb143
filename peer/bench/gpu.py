"""`anchormesh bench gpu --out OUT`: the GPU path checked end to end, in one short run.

Three parts, each a yes/no a volunteer or a reviewer can read off OUT:

(a) `precision`: a Llama-3.2-1B-shaped model built from a config (random init, no download), 2
    stages in one process through the real runner (low-rank codec, serialized wire messages), in
    fp32, bf16 (fp32 masters) and bf16 with activation checkpointing: tokens/s, the peak memory
    against the plan's estimate (peer/daemon/memory.py), and host syncs per micro-batch (CUDA's sync
    debug mode counts them; the two wire crossings per message are the expected ones).
(b) `swarm`: bootstrap + 2 stages x 2 peers as processes with `--device DEVICE`, 40 steps:
    averaging rounds done and none refused, an anchor prior folded in, an eval loss, and one
    peer SIGKILLed at step 20 and restarted from its checkpoint.
(c) `memory_refusal`: a run whose memory budget no stage fits: the peer exits 2 naming the
    estimate, before anything loads.

On a CPU (`--device cpu`, what CI can run) the same code runs a small model shape, and the peak
is the live tensor storages plus the profiler's allocation peak over one step (torch keeps no
CPU allocator statistics).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import signal
import tempfile
import time
import warnings
from pathlib import Path

import torch

from peer.bench import emit_json
from peer.config import MaskConfig, ModelConfig, OptimConfig, PipelineConfig, TrainConfig
from peer.daemon.memory import GIB, plan_stages
from peer.model.placement import Placement, parse_device

log = logging.getLogger("anchormesh.bench.gpu")

# Llama-3.2-1B's published config (hidden 2048, 16 layers, GQA 32/8, vocab 128256, tied head)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rope_theta=500000.0,
)
# the 1B's width, heads and vocabulary with 4 of its 16 layers: what a 2-core CPU box can measure
LLAMA_1B_4L = {**LLAMA_1B, "num_hidden_layers": 4}
SMALL = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
SHAPES = {"llama-3.2-1b": LLAMA_1B, "llama-3.2-1b-4l": LLAMA_1B_4L, "small": SMALL}
PARTS = ("precision", "swarm", "memory_refusal")


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage once)."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.device.type == "cpu" and not obj.is_meta:
                st = obj.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # an object that looks like a tensor but has no storage
            continue
    return sum(seen.values())


def cpu_peak_bytes(step) -> int:
    """Peak tensor bytes on the CPU while `step()` runs: what was alive before it plus the
    highest point of the allocations the profiler records during it (torch has no CPU
    allocator statistics like CUDA's max_memory_allocated)."""
    from torch.profiler import ProfilerActivity, profile

    before = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    now = peak = 0
    for e in sorted(
        prof.events(), key=lambda e: e.time_range.start
    ):  # op granularity: each op's own net bytes, frees outside ops
        now += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, now)
    return before + peak


def _shape_dir(shape: dict, root: Path) -> Path:
    """A model folder holding only config.json: enough for the meta build the plan needs."""
    from transformers import LlamaConfig

    path = root / "model"
    LlamaConfig(**shape).save_pretrained(path)
    return path


def _pipeline(device: torch.device, quick: bool) -> PipelineConfig:
    if device.type == "cuda":
        return PipelineConfig(micro_batch_size=4, micro_batches=4, seq_len=512, eval_every=0, max_staleness=0)
    return PipelineConfig(
        micro_batch_size=2, micro_batches=2, seq_len=64 if quick else 128, eval_every=0, max_staleness=0
    )


def precision(device: torch.device, shape: dict, root: Path, steps: int, quick: bool) -> dict:
    """Part (a): tokens/s, peak memory vs plan and host syncs, per precision mode."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from peer.pipeline.local import LocalPipelineRunner

    folder = _shape_dir(shape, root)
    pipe = _pipeline(device, quick)
    cfg = TrainConfig(
        model=ModelConfig(
            name=str(folder),
            num_stages=2,
            num_layers=shape["num_hidden_layers"],
            hidden_size=shape["hidden_size"],
            num_heads=shape["num_attention_heads"],
            max_seq_len=pipe.seq_len,
        ),
        mask=MaskConfig(scheme="lowrank", rank=64, values="int8", basis_refresh=100),
        optim=OptimConfig(lr=1e-4),
        pipeline=pipe,
        steps=steps,
    )
    gen = torch.Generator().manual_seed(0)
    windows = [
        torch.randint(0, shape["vocab_size"], (pipe.micro_batch_size, pipe.seq_len + 1), generator=gen)
        for _ in range(8)
    ]
    modes = {
        "fp32": Placement(device=device),
        "bf16": Placement(device=device, compute_dtype=torch.bfloat16),
        "bf16_checkpointing": Placement(device=device, compute_dtype=torch.bfloat16, checkpointing=True),
    }
    out = {}
    for name, placement in modes.items():
        t0 = time.monotonic()
        plans = plan_stages(cfg, placement)
        config = LlamaConfig(**shape)
        config._attn_implementation = "sdpa"
        with torch.device(device):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        runner = LocalPipelineRunner(
            cfg, model, lambda step, r, j: windows[(step * pipe.micro_batches + j) % len(windows)], placement=placement
        )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        runner.run(2)  # warm-up: kernels, the first basis, the working copy
        syncs = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("warn")
        t1 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports = runner.run(2 + steps)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
        seconds = time.perf_counter() - t1
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        micro_batches = steps * pipe.micro_batches
        planned = sum(p.total for p in plans)
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
        else:  # one more step under the profiler (slow: after the timed ones)
            peak = cpu_peak_bytes(functools.partial(runner.run, 3 + steps))
        out[name] = {
            "tokens_per_s": steps * pipe.micro_batches * pipe.micro_batch_size * pipe.seq_len / seconds,
            "loss_first": reports[0].loss,
            "loss_last": reports[-1].loss,
            "planned_gib": planned / GIB,
            "planned_per_stage_gib": [p.total / GIB for p in plans],
            "peak_gib": peak / GIB,
            "peak_over_plan": peak / planned,
            "peak_measured_by": "torch.cuda.max_memory_allocated"
            if device.type == "cuda"
            else "live tensor storages + the profiler's allocation peak over one step",
            "host_syncs": syncs if device.type == "cuda" else None,
            "host_syncs_per_micro_batch": syncs / micro_batches if device.type == "cuda" else None,
            "seconds": time.monotonic() - t0,
        }
        log.info(
            "precision %s: %.0f tokens/s, planned %.2f GiB, peak %.2f GiB (%.0fs)",
            name,
            out[name]["tokens_per_s"],
            planned / GIB,
            peak / GIB,
            out[name]["seconds"],
        )
        runner.close()
        del runner
        gc.collect()  # the next mode builds its model in this memory
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


SWARM_RUN = """
seed = 1
[model]
name = "tiny-llama"
num_stages = 2
hidden_size = {hidden}
num_layers = 4
num_heads = 4
max_seq_len = 128
[codec]
scheme = "lowrank"
[codec.lowrank]
rank = 32
[dp]
inner_steps = 5
[anchor]
every = 10
[spectral]
mode = "paper"
[pipeline]
micro_batch_size = 4
micro_batches = 2
seq_len = 128
eval_every = 10
[checkpoint]
every = 10
"""


def swarm(device: str, root: Path, steps: int = 40, kill_at: int = 20, timeout_s: float = 240.0) -> dict:
    """Part (b): a 2 x 2 swarm on `device`; one peer SIGKILLed at `kill_at` and restarted."""
    from peer.client.view import status_dict
    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

    (root / "run.toml").write_text(SWARM_RUN.format(hidden=512 if device.startswith("cuda") else 64))
    procs, t0 = [], time.monotonic()

    def status() -> dict | None:
        import grpc

        from peer.security import auth
        from peer.wire import anchormesh_pb2 as pb
        from peer.wire import anchormesh_pb2_grpc as pbg

        try:  # the Status service is open to anyone who can reach the tracker
            with auth.open_channel(info["tracker"], None) as channel:
                return status_dict(pbg.StatusStub(channel).GetStatus(pb.StatusRequest(), timeout=5))
        except grpc.RpcError:  # not up yet
            return None

    def wait(what, why: str) -> dict:
        while time.monotonic() - t0 < timeout_s:
            s = status()
            if s is not None and what(s):
                return s
            time.sleep(1.0)
        raise TimeoutError(f"swarm: timed out waiting for {why}; last status step {s and s.get('step')}")

    result: dict = {"device": device, "steps": steps}
    try:
        procs.append(
            start_process(
                ["bootstrap", "--config", str(root / "run.toml"), "--state-dir", str(root / "boot")], root / "boot.log"
            )
        )
        info = wait_for_bootstrap(root / "boot", procs[0], root / "boot.log")
        peer_args = lambda i: [
            "peer",
            "--tracker",
            info["tracker"],
            "--token",
            info["token"],
            "--device",
            device,
            "--state-dir",
            str(root / f"peer{i}"),
        ]  # noqa: E731
        peers = {i: start_process(peer_args(i), root / f"peer{i}.log") for i in range(4)}
        procs += peers.values()
        s = wait(lambda s: s["step"] >= 1, "the first step")
        result["seconds_to_first_step"] = time.monotonic() - t0
        s = wait(lambda s: s["step"] >= kill_at, f"step {kill_at}")
        victim = next(p for p in s["peers"] if p["stage"] == 1 and p["state"] in ("active", "idle"))
        index = next(i for i in range(4) if victim["id"] in (root / f"peer{i}.log").read_text())
        peers[index].send_signal(
            signal.SIGKILL
        )  # its process group (p2pd, hivemind's children) is killed by stop_processes
        peers[index].wait(10)
        result["killed"] = {"peer": victim["id"], "at_step": s["step"]}
        procs.append(start_process(peer_args(index), root / f"peer{index}-restart.log"))

        def done(s: dict) -> bool:  # 4 live peers at `steps`, each with a round behind it
            live = [p for p in s["peers"] if p["state"] in ("active", "idle")]
            return s["step"] >= steps and len(live) >= 4 and all(p["dp_rounds"] for p in live)

        s = wait(done, f"step {steps} with 4 live peers that each averaged")
        restart_log = (root / f"peer{index}-restart.log").read_text()
        result["dp_refusals"] = [
            line.split("anchormesh.")[-1][:300]
            for f in sorted(root.glob("peer*.log"))
            for line in f.read_text().splitlines()
            if "result rejected" in line
        ]
        live = [p for p in s["peers"] if p["state"] in ("active", "idle")]
        result.update(
            {
                "step": s["step"],
                "loss": s["loss"],
                "eval_loss": s["eval_loss"],
                "anchor_age_steps": s["anchor_age_steps"],
                "anchor_priors_folded": sum(1 for p in live if p["anchor_id"]),
                "dp_rounds": {p["id"]: p["dp_rounds"] for p in live},
                "dp_rejected": sum(p["dp_rejected"] for p in live),
                "devices": sorted({p["device"] or "" for p in live}),
                "restart_resumed_from": "checkpoint"
                if "took the stage state of checkpoint" in restart_log
                else "group"
                if "took the stage state of a group member" in restart_log
                else None,
                "seconds": time.monotonic() - t0,
            }
        )
        result["ok"] = bool(
            min(result["dp_rounds"].values()) > 0
            and result["dp_rejected"] == 0
            and result["anchor_priors_folded"]
            and result["eval_loss"] is not None
            and result["restart_resumed_from"]
        )
    except (TimeoutError, RuntimeError, StopIteration) as exc:
        result.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        stop_processes(procs)
    log.info("swarm on %s: %s", device, json.dumps(result)[:400])
    return result


def memory_refusal(device: str, root: Path) -> dict:
    """Part (c): a budget no stage fits; the peer must exit 2 naming the estimate."""
    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

    (root / "run.toml").write_text(SWARM_RUN.format(hidden=64) + "[compute]\nmemory_budget_gib = 0.001\n")
    procs = [
        start_process(
            ["bootstrap", "--config", str(root / "run.toml"), "--state-dir", str(root / "boot")], root / "boot.log"
        )
    ]
    try:
        info = wait_for_bootstrap(root / "boot", procs[0], root / "boot.log")
        procs.append(
            start_process(
                ["peer", "--tracker", info["tracker"], "--token", info["token"], "--device", device], root / "peer.log"
            )
        )
        rc = procs[1].wait(timeout=120)
        text = (root / "peer.log").read_text()
        line = next((x for x in text.splitlines() if "no stage of this run fits" in x), "")
        return {
            "exit_code": rc,
            "message": line[-400:],
            "ok": rc == 2 and "needs" in line and "GiB" in line and "joined" not in text,
        }
    finally:
        stop_processes(procs)


def run(device: str = "auto", parts: tuple[str, ...] = PARTS, quick: bool = False, shape: str | None = None) -> dict:
    dev = parse_device(device)
    shape_name = shape or ("llama-3.2-1b" if dev.type == "cuda" else "small")
    dims = SHAPES[shape_name]
    t0 = time.monotonic()
    result: dict = {
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": shape_name,
        "model_dims": dims,
        "seq_len": _pipeline(dev, quick).seq_len,
    }
    with tempfile.TemporaryDirectory(prefix="anchormesh-gpu-") as tmp:
        root = Path(tmp)
        for part in parts:
            (root / part).mkdir()
            log.info("bench gpu: %s ...", part)
            if part == "precision":
                result[part] = precision(dev, dims, root / part, steps=3 if quick else 10, quick=quick)
            elif part == "swarm":
                result[part] = swarm(str(dev), root / part)
            elif part == "memory_refusal":
                result[part] = memory_refusal(str(dev), root / part)
    result["seconds"] = time.monotonic() - t0
    return result


def main_json(path: Path | None, device: str, parts: tuple[str, ...], quick: bool, shape: str | None) -> dict:
    from peer.logs import setup_logging

    setup_logging()
    return emit_json(run(device, parts, quick, shape), path)
