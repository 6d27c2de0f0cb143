"""What one stage needs in memory, planned before anything loads.

Why: a volunteer's 24 GB GPU must be checked against the stage it is offered before it spends
minutes downloading weights and then dies of an out-of-memory error in its first backward. The
plan is built from a meta-device stage (shapes, no memory): parameter counts give the weights,
gradients and optimizer state exactly, and one forward on meta tensors under
`saved_tensors_hooks` measures what autograd keeps per micro-batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from peer.config import TrainConfig
from peer.errors import ConfigError
from peer.model.loading import meta_stages
from peer.model.placement import DTYPE_NAMES, Placement
from peer.model.stages import StageModule
from peer.pipeline.codecs import codec_class
from peer.pipeline.weights import keeps_last_update, swarm_stashes

GIB = 2**30
MAX_SNAPSHOT_SLOTS = 8
REPLICA_BYTES_PER_PARAMETER = 12  # fp32 weights, exp_avg, exp_avg_sq (peer/daemon/replicas.py)
COMPONENTS = (
    "weights",
    "working_copy",
    "grads",
    "optimizer",
    "dp_copies",
    "anchor_snapshot",
    "activations",
    "logits",
    "codec",
)


@dataclass
class MemoryPlan:
    """Bytes one stage needs on its device, per component, plus the host bytes it needs besides.

    weights: master weights (master dtype). working_copy: the compute-dtype copy of mixed
    precision, and in the swarm the stashed copies forwards run on (two versions alive at once: a
    middle stage, and stage 0 with pipeline.max_staleness > 0; with the look-ahead one more per
    delay, and the last update in the master dtype; peer/pipeline/weights.py).
    grads: master dtype. optimizer: AdamW's exp_avg + exp_avg_sq (fp32).
    dp_copies: the stage-group averager's fp32 base copy. anchor_snapshot: one compute-dtype copy of the
    weights. activations: saved tensors of every micro-batch in flight. logits: last stage, one
    micro-batch's logits, their fp32 copy for the loss and its gradient. codec: link priors and
    bases. host: the averager's shared-memory fp32 copy on the CPU and the copy of what it last
    sent, kept to prove it to auditors (peer/dp/commitment.py): 8 bytes per parameter. replica: the copy of the next
    stage's training state (fp32 weights and both AdamW moments, 12 bytes per parameter) that a
    peer without a state dir may be asked to keep in host memory (peer/daemon/replicas.py).
    The remaining fields describe the settings, so a refusal can say what to change.
    """

    stage: int
    layers: int
    device: str
    weights: int = 0
    working_copy: int = 0
    grads: int = 0
    optimizer: int = 0
    dp_copies: int = 0
    anchor_snapshot: int = 0
    activations: int = 0
    logits: int = 0
    codec: int = 0
    host: int = 0
    replica: int = 0
    activations_checkpointed: int = 0  # what `activations` would be with checkpointing on
    compute_dtype: str = "fp32"
    checkpointing: bool = False
    micro_batch_size: int = 1
    micro_batches_in_flight: int = 1
    num_stages: int = 1
    anchor_every: int = 0
    prior_rows: int = 0

    @property
    def total(self) -> int:
        """Device bytes: every component but `host`."""
        return sum(getattr(self, c) for c in COMPONENTS)

    def need(self, device: torch.device | str | None = None) -> int:
        """Bytes the plan takes from `device`'s free memory: on the CPU the host copies share it."""
        dev = torch.device(device if device is not None else self.device)
        return self.total + (self.host + self.replica if dev.type == "cpu" else 0)

    def describe(self) -> str:
        """One line per component, then the totals (for logs and the docs)."""
        rows = [
            f"stage {self.stage} ({self.layers} layers) on {self.device}, {self.compute_dtype}"
            + (", checkpointing" if self.checkpointing else "")
        ]
        rows += [f"  {c:<16}{_fmt(getattr(self, c)):>12}" for c in COMPONENTS]
        rows += [
            f"  {'total':<16}{_fmt(self.total):>12}",
            f"  {'host':<16}{_fmt(self.host):>12}",
            f"  {'replica (host)':<16}{_fmt(self.replica):>12}",
        ]
        return "\n".join(rows)


def _fmt(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def plan_stage(cfg: TrainConfig, placement: Placement, index: int, *, dp_group: bool = False) -> MemoryPlan:
    """The memory plan of stage `index` under `placement`. `dp_group`: the stage is averaged with
    other replicas (dp.replicas > 1, or any swarm peer), so the averager keeps its copies."""
    return _plan(cfg, placement, meta_stages(cfg.model, [index])[0], dp_group)


def plan_stages(
    cfg: TrainConfig, placement: Placement, dp_group: bool = False, replica_in_memory: bool = False
) -> list[MemoryPlan]:
    """The plan of every stage of the run, from one meta build (what a peer sends at Join, so
    the tracker gives it a stage that fits). `replica_in_memory`: a swarm peer with no state dir
    keeps the next stage's replica in host memory when the tracker picks it as a holder; the plan
    counts it for every stage, since the pick comes after the Join."""
    stages = meta_stages(cfg.model, list(range(cfg.model.num_stages)))
    plans = [_plan(cfg, placement, stage, dp_group) for stage in stages]
    if replica_in_memory and len(stages) > 1 and cfg.checkpoint.replicate_every_s > 0:
        for i, plan in enumerate(plans):
            plan.replica = REPLICA_BYTES_PER_PARAMETER * sum(
                p.numel() for p in stages[(i + 1) % len(stages)].parameters()
            )
    return plans


def plan_table(cfg: TrainConfig, placement: Placement, dp_group: bool = False) -> list[dict[str, float | int]]:
    """One row per stage: its layers and every component in GiB (the docs print it)."""
    rows = []
    for plan in plan_stages(cfg, placement, dp_group):
        rows.append(
            {"stage": plan.stage, "layers": plan.layers}
            | {c: getattr(plan, c) / GIB for c in (*COMPONENTS, "total", "host", "replica")}
        )
    return rows


def _plan(cfg: TrainConfig, placement: Placement, stage: StageModule, dp_group: bool) -> MemoryPlan:
    n = sum(p.numel() for p in stage.parameters())
    master = torch.empty((), dtype=placement.master_dtype).element_size()
    compute = torch.empty((), dtype=placement.compute_dtype).element_size()
    pipe = cfg.pipeline
    in_flight = pipe.micro_batches * (pipe.max_staleness + 1)
    outside, per_layer = saved_activation_bytes(stage, pipe.micro_batch_size, pipe.seq_len, placement.compute_dtype)
    layer_inputs = len(per_layer) * pipe.micro_batch_size * pipe.seq_len * stage.hidden_size * compute
    full = outside + sum(per_layer)
    # checkpointing keeps each layer's input; the backward recomputes one layer's saved tensors at a time
    checkpointed = outside + layer_inputs + max(per_layer, default=0)
    tokens = pipe.micro_batch_size * pipe.seq_len
    stashes, delta = 0, 0
    if dp_group and swarm_stashes(stage, pipe.max_staleness):
        look = keeps_last_update(stage, pipe.max_staleness, pipe.staleness_correction == "lookahead", swarm=True)
        # two versions alive at once; with the look-ahead one stash per delay at the current
        # version (0..max_staleness) plus the last version's, and the last update (master dtype)
        stashes = pipe.max_staleness + 2 if look else 2
        delta = n * master if look else 0
    return MemoryPlan(
        stage=stage.index,
        layers=stage.end - stage.start,
        device=str(placement.device),
        weights=n * master,
        working_copy=(n * compute if placement.mixed else 0) + stashes * n * compute + delta,
        grads=n * master
        + (n * compute if placement.mixed else 0),  # mixed: the working copy's gradients live until summed into fp32
        optimizer=2 * n * 4,
        dp_copies=n * 4 if dp_group else 0,
        anchor_snapshot=n * compute
        if cfg.anchor.every > 0
        else 0,  # in the compute dtype (peer/pipeline/swarm_anchor.py)
        activations=in_flight * (checkpointed if placement.checkpointing else full),
        logits=tokens * stage.vocab_size * (compute + 4 + 4) if stage.is_last else 0,
        codec=_codec_bytes(cfg, stage),
        host=n * 8 if dp_group else 0,  # shared-memory copy + the last commitment's copy
        activations_checkpointed=in_flight * checkpointed,
        compute_dtype=DTYPE_NAMES[placement.compute_dtype],
        checkpointing=placement.checkpointing,
        micro_batch_size=pipe.micro_batch_size,
        micro_batches_in_flight=in_flight,
        num_stages=cfg.model.num_stages,
        anchor_every=cfg.anchor.every,
        prior_rows=cfg.mask.prior_rows,
    )


def _codec_bytes(cfg: TrainConfig, stage: StageModule) -> int:
    """Link codec state on the device: what the run's codec keeps (LinkCodec.state_bytes)."""
    return codec_class(cfg.mask.scheme).state_bytes(
        cfg.mask, stage.vocab_size, stage.hidden_size, sends=not stage.is_last, receives=not stage.is_first
    )


class _FusedAttention(torch.autograd.Function):
    """Stands in for SDPA on meta tensors: keeps what a fused (flash / memory-efficient) kernel
    keeps for its backward, q, k, v, the output and the fp32 log-sum-exp [.., T]. Why: on meta,
    SDPA dispatches to its math path, which saves the [B, heads, T, T] attention matrix that the
    fused kernels used on a GPU (and on the CPU) never hold, overestimating long sequences.
    Forward only: the plan never runs a backward through it."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out


class _FusedAttentionMode(TorchFunctionMode):
    """Routes SDPA calls to `_FusedAttention` (thread-local: other threads' SDPA is untouched)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = list(args[:3]) + [kwargs.get(name) for name in ("query", "key", "value")[len(args) :]]
            return _FusedAttention.apply(q, k, v)
        return func(*args, **kwargs)


def saved_activation_bytes(stage: StageModule, batch: int, seq: int, dtype: torch.dtype) -> tuple[int, list[int]]:
    """Bytes autograd saves for one micro-batch's forward of a meta stage in `dtype`:
    (outside the decoder layers, per decoder layer). The stage is converted to `dtype` in place.

    Saved tensors are deduplicated by the identity of their base tensor (views of one tensor
    share its storage; storages cannot be told apart on meta), and parameters are left out (they
    are the weights). Only the forward runs: autograd packs every saved tensor there, the
    backward packs none."""
    stage.to(dtype)
    params = {id(p) for p in stage.parameters()}
    seen: dict[int, torch.Tensor] = {}  # keeps every counted tensor alive so its id stays unique
    buckets = [0] * (len(stage.layers) + 1)  # [outside, layer 0, layer 1, ...]
    current = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params and id(base) not in seen:
            seen[id(base)] = base
            buckets[current[0]] += base.numel() * base.element_size()
        return t

    def enter(i: int):
        return lambda *_: current.__setitem__(0, i + 1)

    hooks = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(stage.layers)]
    hooks += [layer.register_forward_hook(lambda *_: current.__setitem__(0, 0)) for layer in stage.layers]
    if stage.is_first:
        x = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    else:
        x = torch.zeros(batch, seq, stage.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    checkpointing, stage.checkpointing = stage.checkpointing, False
    try:
        with torch.enable_grad(), _FusedAttentionMode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage(x)
    finally:
        stage.checkpointing = checkpointing
        for h in hooks:
            h.remove()
    return buckets[0], buckets[1:]


def free_bytes(device: torch.device | str) -> int:
    """Bytes free on `device` now: the CUDA driver's figure, or MemAvailable on the host."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _fixes(plan: MemoryPlan, budget_gib: float | None) -> list[tuple[str, object, str]]:
    """(field, current value, advice) for the settings that shrink this plan, those for its
    largest component first."""
    ckpt = (
        "compute.activation_checkpointing",
        False,
        f"set compute.activation_checkpointing = true (activations {_fmt(plan.activations)} -> {_fmt(plan.activations_checkpointed)})",
    )
    batch = (
        "pipeline.micro_batch_size",
        plan.micro_batch_size,
        "a smaller pipeline.micro_batch_size (activations and logits shrink with it)",
    )
    flight = (
        "pipeline.micro_batches",
        plan.micro_batches_in_flight,
        "fewer micro-batches in flight (pipeline.micro_batches x (pipeline.max_staleness + 1))",
    )
    bf16 = ("compute.dtype", plan.compute_dtype, 'compute.dtype = "bf16" (halves activations and logits)')
    stages = ("model.num_stages", plan.num_stages, "more stages (model.num_stages): each holds fewer layers")
    usable = {
        ckpt: not plan.checkpointing and plan.activations > plan.activations_checkpointed,
        batch: plan.micro_batch_size > 1,
        flight: plan.micro_batches_in_flight > 1,
        bf16: plan.compute_dtype == "fp32",
    }
    advice = {
        "activations": [ckpt, batch, flight, bf16],
        "logits": [batch, bf16],
        "anchor_snapshot": [
            ("anchor.every", plan.anchor_every, "no anchors (anchor.every = 0): no weight snapshot"),
            stages,
        ],
        "codec": [
            (
                "codec.lowrank.prior_rows",
                plan.prior_rows,
                "a smaller codec.lowrank.prior_rows, or a codec.mask.fill without a token prior",
            )
        ],
    }
    out: list[tuple[str, object, str]] = []
    for component in sorted(COMPONENTS, key=lambda c: -getattr(plan, c)):
        if getattr(plan, component):
            out += [f for f in advice.get(component, [stages]) if usable.get(f, True) and f not in out]
    if budget_gib is not None:
        out.append(("compute.memory_budget_gib", budget_gib, "a larger compute.memory_budget_gib (0: all free memory)"))
    return out


def check_fits(plan: MemoryPlan, free: int, budget_gib: float = 0.0, device: torch.device | str | None = None) -> None:
    """Refuse a stage whose plan exceeds the budget (`budget_gib` GiB when > 0, else `free`)
    before anything loads; the message names both figures and the settings that help most."""
    dev = str(device if device is not None else plan.device)
    need = plan.need(dev)
    limit = int(budget_gib * GIB) if budget_gib > 0 else free
    if need <= limit:
        return
    parts = ", ".join(
        f"{c} {_fmt(getattr(plan, c))}" for c in sorted(COMPONENTS, key=lambda c: -getattr(plan, c)) if getattr(plan, c)
    )
    if need != plan.total:
        parts += f", host copy {_fmt(plan.host)}"
    have = f"compute.memory_budget_gib allows {_fmt(limit)}" if budget_gib > 0 else f"{_fmt(free)} are free"
    fixes = _fixes(plan, budget_gib if 0 < limit < free else None)
    field, value = (fixes[0][0], fixes[0][1]) if fixes else ("compute.memory_budget_gib", budget_gib)
    advice = "; ".join(f[2] for f in fixes) or "a device with more free memory"
    raise ConfigError(
        field, value, f"stage {plan.stage} needs {_fmt(need)} on {dev} ({parts}), {have}; to fit: {advice}"
    )


def anchor_snapshot_slots(free_after_plan: int, snapshot_bytes: int, share: float) -> int:
    """How many bf16 anchor snapshots to keep: as many as fit in `share` of the memory the plan
    leaves, at least 1 (the plan already counts one) and at most MAX_SNAPSHOT_SLOTS."""
    if snapshot_bytes <= 0:
        return MAX_SNAPSHOT_SLOTS
    return max(1, min(MAX_SNAPSHOT_SLOTS, int(max(free_after_plan, 0) * share) // snapshot_bytes))
