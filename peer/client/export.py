"""`anchormesh export`: the live swarm's newest weights as a standard Hugging Face model folder.

It asks the tracker for the run's config (`Tracker.GetConfig`) and its live peers
(`Status.GetStatus`), downloads each stage's weights from the stage's most-trained live peer
(`Stage.GetShard`; the next one if that fails), checks that every stage is there and that every
tensor has the name and shape the run's model expects, merges them under the full model's names
and writes them with the model's own `save_pretrained` (config.json, model.safetensors,
generation_config.json), plus the tokenizer the run trained with (`data.tokenizer`: the byte
tokenizer, or the model's own) and `anchormesh_export.json` (which peer and step each stage came
from).

Stages step on their own, so the stages of one export may be a step or two apart (at most the
run's staleness bound): the same weights the pipeline computes with at that moment.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from peer import __version__
from peer.build import build, release_of
from peer.config import TrainConfig
from peer.errors import AnchormeshError, ConfigError
from peer.logs import setup_logging
from peer.progress import byte_bar
from peer.runtoml import config_from_dict
from peer.security import auth
from peer.security.call_check import NO_TOKEN_HINT
from peer.store.shard import Shard, ShardError, read_shard
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

log = logging.getLogger("anchormesh.export")
SERVING = ("active", "idle")  # a joining peer may still hold its initial weights
MAX_SHARD_MESSAGE = 8 << 20


class ExportError(AnchormeshError):
    """Why the export cannot be made; one line, the CLI exits 1 with it."""


@dataclass
class ExportResult:
    out: Path
    run_id: str
    config: TrainConfig
    shards: list[Shard] = field(default_factory=list)  # one per stage, in stage order


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def ask_tracker(
    tracker: str, timeout_s: float = 10.0, creds: auth.Credentials | None = None, tls_ca: bytes | None = None
) -> tuple[pb.RunConfig, pb.RunStatus]:
    """The run's config and status; ExportError when the tracker does not answer or refuses."""
    with auth.tracker_channel(tracker, creds, tls_ca=tls_ca) as channel:
        try:
            run = pbg.TrackerStub(channel).GetConfig(pb.ConfigRequest(), timeout=timeout_s)
            status = pbg.StatusStub(channel).GetStatus(pb.StatusRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise ExportError(f"tracker {tracker} does not serve GetConfig (an older anchormesh?)") from None
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise ExportError(f"tracker {tracker} refused: {exc.code().name}: {_one_line(exc.details())}") from None
            raise ExportError(
                f"tracker {tracker} unreachable ({exc.code().name}: {_one_line(exc.details())})"
            ) from None
    return run, status


def candidates(status: pb.RunStatus, num_stages: int) -> list[list[pb.PeerInfo]]:
    """Per stage, its serving peers, most-trained first; ExportError naming every stage without one."""
    by_stage: list[list[pb.PeerInfo]] = [[] for _ in range(num_stages)]
    for p in status.peers:
        if p.state in SERVING and p.stage < num_stages:
            by_stage[p.stage].append(p)
    missing = [s for s in range(num_stages) if not by_stage[s]]
    if missing:
        which = f"stage {missing[0]} has" if len(missing) == 1 else f"stages {', '.join(map(str, missing))} have"
        raise ExportError(
            f"{which} no live peer (run {status.run_id} is {status.state or 'unknown'}): nothing to export from"
        )
    return [sorted(peers, key=lambda p: (-p.step, p.peer_id)) for peers in by_stage]


def download(
    peer: pb.PeerInfo,
    run_id: str,
    timeout_s: float,
    progress: bool = True,
    creds: auth.Credentials | None = None,
    tls_ca: bytes | None = None,
) -> Shard:
    """One peer's stage weights over GetShard, with a byte progress bar."""
    options = [("grpc.max_receive_message_length", MAX_SHARD_MESSAGE)]
    with auth.open_channel(peer.address, creds, options, tls_ca) as channel:
        call = channel.unary_stream(
            "/anchormesh.v1.Stage/GetShard",
            request_serializer=pb.ShardRequest.SerializeToString,
            response_deserializer=pb.ShardChunk.FromString,
        )
        bar = byte_bar(f"stage {peer.stage} <- {peer.peer_id}", show=None if progress else False)
        try:

            def advance(n: int, total: int) -> None:
                bar.total = total
                bar.update(n)

            return read_shard(
                call(pb.ShardRequest(run_id=run_id, sender="anchormesh-export"), timeout=timeout_s), advance
            )
        finally:
            bar.close()


def hf_config(cfg: TrainConfig):
    """The run's model config as Hugging Face sees it. Untied embedding and head: every stage owns
    its own copy of the modules (peer/model/stages.py), so a tied pair is two trained tensors."""
    from peer.model.loading import TINY_PREFIX, tiny_config
    from peer.model.source import pretrained_config

    if cfg.model.name.startswith(TINY_PREFIX):
        config = tiny_config(cfg.model.name[len(TINY_PREFIX) :], cfg.model)
        # the byte vocabulary has no special tokens: Llama's default bos/eos ids (1, 2) would be bytes
        config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    else:
        config = pretrained_config(cfg.model.name)
    config.tie_word_embeddings = False
    return config


def expected_shapes(config, num_stages: int) -> list[dict[str, tuple[int, ...]]]:
    """Per stage: full-model parameter name -> shape, from the model cut as the peers cut it
    (built on the meta device: names and shapes only, no memory)."""
    from transformers import AutoModelForCausalLM

    from peer.model.stages import split_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return [
        {stage.hf_names[n]: tuple(p.shape) for n, p in stage.named_parameters()}
        for stage in split_model(model, num_stages)
    ]


def check_fits(shard: Shard, stage: int, num_stages: int, run_id: str, want: dict[str, tuple[int, ...]]) -> None:
    """ShardError unless `shard` is stage `stage` of this run with exactly the expected tensors."""
    if shard.run_id != run_id:
        raise ShardError(f"it is of run {shard.run_id!r}, not {run_id!r}")
    if (shard.stage, shard.num_stages) != (stage, num_stages):
        raise ShardError(
            f"it is stage {shard.stage} of {shard.num_stages}, not stage {stage} of {num_stages} (the peer moved?)"
        )
    missing, extra = sorted(set(want) - set(shard.tensors)), sorted(set(shard.tensors) - set(want))
    if missing or extra:
        raise ShardError(
            f"tensors missing: {', '.join(missing[:3]) or 'none'}; unexpected: {', '.join(extra[:3]) or 'none'}"
        )
    for name, t in shard.tensors.items():
        if tuple(t.shape) != want[name] or not t.is_floating_point():
            raise ShardError(f"{name} is {t.dtype} {list(t.shape)}, the model needs a float {list(want[name])}")
        if not torch.isfinite(t).all():
            raise ShardError(f"{name} holds NaN or Inf")


def gather(
    tracker: str, timeout_s: float = 300.0, progress: bool = True, token: str | None = None, tls_ca: bytes | None = None
) -> tuple[TrainConfig, str, list[Shard]]:
    """The run's config, run id and one checked shard per stage, each from its most-trained live
    peer; `token` is the run token (the tracker and the peers hand weights only to its holders)."""
    if not token:
        raise ExportError(f"exporting a live run needs its token: {NO_TOKEN_HINT}")
    creds = auth.Credentials(token=token)
    run, status = ask_tracker(tracker, creds=creds, tls_ca=tls_ca)
    if release_of(run.code_version) != __version__:  # the model's code is the release's; a commit apart cuts alike
        log.warning(
            "the tracker runs anchormesh %s, this is %s: the model may not be cut the same way",
            run.code_version,
            build(),
        )
    cfg = config_from_dict(json.loads(run.run_config_json))
    K = cfg.model.num_stages
    peers = candidates(status, K)
    want = expected_shapes(hf_config(cfg), K)
    shards: list[Shard] = []
    for s in range(K):
        reasons = []
        for peer in peers[s]:
            t0 = time.monotonic()
            try:
                shard = download(peer, run.run_id, timeout_s, progress, creds, tls_ca)
                check_fits(shard, s, K, run.run_id, want[s])
            except grpc.RpcError as exc:
                reasons.append(f"peer {peer.peer_id} at {peer.address}: {exc.code().name}: {_one_line(exc.details())}")
            except ShardError as exc:
                reasons.append(f"the shard of peer {peer.peer_id} does not fit the run's model: {exc}")
            else:
                size = sum(t.numel() * t.element_size() for t in shard.tensors.values())
                log.info(
                    "stage %d: %d tensors (%.1f MB) from %s at step %d in %.1fs",
                    s,
                    len(shard.tensors),
                    size / 1e6,
                    peer.peer_id,
                    shard.step,
                    time.monotonic() - t0,
                )
                shards.append(shard)
                break
            log.warning("stage %d: %s", s, reasons[-1])
        else:
            raise ExportError(f"stage {s}: " + "; ".join(reasons))
    steps = [sh.step for sh in shards]
    if max(steps) - min(steps) > cfg.pipeline.max_staleness + 1:
        log.warning("the stages are at steps %s: further apart than the run's staleness bound", steps)
    return cfg, run.run_id, shards


def write_model(cfg: TrainConfig, shards: list[Shard], out: Path) -> None:
    """Merge the shards into the full model and write it (plus tokenizer and provenance) to `out`."""
    from transformers import AutoModelForCausalLM

    from peer.model.tokenizer import hf_byte_tokenizer

    merged = {name: t for shard in shards for name, t in shard.tensors.items()}
    model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.float32, attn_implementation="sdpa")
    params = dict(model.named_parameters())
    if set(params) != set(merged):  # expected_shapes cut this same config: only a bug gets here
        raise ExportError(
            f"the merged shards do not name the model's parameters: missing {sorted(set(params) - set(merged))[:3]}, extra {sorted(set(merged) - set(params))[:3]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(merged[name])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if cfg.data.tokenizer == "model":
        from peer.model.source import load_tokenizer

        try:
            load_tokenizer(cfg.model.name).save_pretrained(out)
        except ConfigError as exc:
            raise ExportError(
                f"cannot load the tokenizer of {cfg.model.name} to export with the model: {exc}"
            ) from None
        tokenizer_note = f"the model's own: {cfg.model.name}"
    else:
        hf_byte_tokenizer(cfg.model.max_seq_len).save_pretrained(out)
        tokenizer_note = "bytes: token id = byte value (peer/model/tokenizer.py), no special tokens"
    (out / "anchormesh_export.json").write_text(
        json.dumps(
            {
                "run_id": shards[0].run_id,
                "time": time.time(),
                "code_version": build(),
                "stages": [{"stage": sh.stage, "peer_id": sh.peer_id, "step": sh.step} for sh in shards],
                "tokenizer": tokenizer_note,
            },
            indent=2,
        )
        + "\n"
    )


def export(
    tracker: str,
    out: Path,
    timeout_s: float = 300.0,
    progress: bool = True,
    token: str | None = None,
    tls_ca: bytes | None = None,
) -> ExportResult:
    """Gather the newest shards from the swarm behind `tracker` and write a Hugging Face folder."""
    cfg, run_id, shards = gather(tracker, timeout_s, progress, token, tls_ca)
    write_model(cfg, shards, out)
    log.info("wrote %s: run %s, stages at steps %s", out, run_id, [sh.step for sh in shards])
    return ExportResult(out, run_id, cfg, shards)


def gather_checkpoints(dirs: list[Path], run_id: str | None = None) -> tuple[TrainConfig, str, list[Shard]]:
    """The run's config and, per stage, the newest checkpoint that checks out across `dirs`
    (peers' state dirs, or their `checkpoints/` folders). Why: once a run ends (its token budget
    spent) the peers leave, and their checkpoints are where the trained weights are."""
    from peer.store.checkpoint import ShardCheckpoints, run_dirs

    runs: dict[str, list[Path]] = {}
    for d in dirs:
        if not d.is_dir():
            raise ExportError(f"{d}: no such folder")
        for rid, folder in run_dirs(d).items():
            runs.setdefault(rid, []).append(folder)
    if not runs:
        raise ExportError(
            f"no checkpoints under {', '.join(map(str, dirs))} (a peer writes them to --state-dir/checkpoints/RUN/stageK/)"
        )
    if run_id is None:
        if len(runs) > 1:
            raise ExportError(f"checkpoints of several runs ({', '.join(sorted(runs))}): choose one with --run")
        run_id = next(iter(runs))
    elif run_id not in runs:
        raise ExportError(f"no checkpoints of run {run_id!r}; found: {', '.join(sorted(runs))}")
    info = next((f / "run.json" for f in runs[run_id] if (f / "run.json").is_file()), None)
    if info is None:
        raise ExportError(f"run {run_id}: no run.json beside its checkpoints, so its config is unknown")
    try:
        record = json.loads(info.read_text())
        cfg = config_from_dict(record["config"])
    except (ValueError, KeyError, TypeError, AnchormeshError) as exc:
        raise ExportError(f"{info}: not a readable run record ({exc})") from None
    if release_of(str(record.get("code_version"))) != __version__:
        log.warning(
            "the checkpoints were written by anchormesh %s, this is %s: the model may not be cut the same way",
            record.get("code_version"),
            build(),
        )
    K = cfg.model.num_stages
    want = expected_shapes(hf_config(cfg), K)
    shards: list[Shard] = []
    for s in range(K):
        found = [
            (step, ck)
            for f in runs[run_id]
            for ck in [ShardCheckpoints(f.parent.parent, run_id, s)]
            for step in ck.steps()
        ]
        reasons = []
        for step, ck in sorted(found, key=lambda x: -x[0]):
            try:
                got = ck.load(step)
                n = len(got.tensors) // 3
                if got.hf_names is None or len(got.hf_names) != n:
                    raise ShardError("it has no full-model parameter names (written by an older anchormesh)")
                shard = Shard(run_id, str(got.path), s, K, got.step, dict(zip(got.hf_names, got.tensors[:n])))
                check_fits(shard, s, K, run_id, want[s])
            except (ValueError, ShardError) as exc:
                reasons.append(f"{ck.dir} step {step}: {exc}")
                log.warning("stage %d: skipping %s", s, reasons[-1])
                continue
            log.info("stage %d: step %d from %s", s, shard.step, got.path)
            shards.append(shard)
            break
        else:
            raise ExportError(
                f"stage {s}: no checkpoint that fits"
                + (": " + "; ".join(reasons) if reasons else f" (none under {', '.join(str(f) for f in runs[run_id])})")
            )
    return cfg, run_id, shards


def export_checkpoints(dirs: list[Path], out: Path, run_id: str | None = None) -> ExportResult:
    """Write a Hugging Face folder from peers' shard checkpoints (no swarm needed)."""
    cfg, run_id, shards = gather_checkpoints(dirs, run_id)
    write_model(cfg, shards, out)
    log.info("wrote %s: run %s, stages at steps %s", out, run_id, [sh.step for sh in shards])
    return ExportResult(out, run_id, cfg, shards)


def run_export(
    tracker: str | None,
    out: Path,
    timeout_s: float = 300.0,
    checkpoints: list[Path] | None = None,
    run_id: str | None = None,
    token: str | None = None,
    tls_ca: bytes | None = None,
) -> int:
    """The CLI: export from the live swarm (`tracker`) or from checkpoints, or one error line and exit code 1."""
    setup_logging()
    try:
        if checkpoints:
            export_checkpoints(checkpoints, out, run_id)
        else:
            export(tracker, out, timeout_s, token=token, tls_ca=tls_ca)
    except ExportError as exc:
        print(f"anchormesh export: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"exported to {out} (load it with transformers.AutoModelForCausalLM.from_pretrained)", flush=True)
    return 0
