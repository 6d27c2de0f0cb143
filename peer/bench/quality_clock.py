"""Modelled figures for `bench quality`: equal-wall-clock quality (what each row's eval loss is
worth against dense training given the same time, on a GPU whose stage link runs at 200
Mbit/s), and each row's bytes per token at a practitioner's sequence length.

A step's time is modelled, not measured here (these rows run on a CPU): compute from FLOPs at
the device's peak x MFU (`peer/bench/project_compute.gpu_compute`, the slowest stage's M
micro-batches plus its AdamW), link time = the row's measured PP bytes per step at the given
rate (both directions counted against one link: conservative for a full-duplex line), and the
two overlap in a pipeline, so a step takes the larger. In the time a row takes for its N steps,
dense training makes N x t_row / t_dense steps; dense's eval loss there is read off its eval
curve (linear between the checkpoints the benchmark evaluated, step 0 = the base model).
"""

from __future__ import annotations

from peer.bench.project_bytes import mask_message_bytes
from peer.bench.project_compute import gpu_compute
from peer.bench.project_model import DEFAULT_MFU, DEVICES, ModelDims, Shape, dims_of_config

LINK_MBIT = 200.0
DEVICE = "rtx4090"


def model_dims(config) -> ModelDims:
    """Sizes of the benchmark's base model, from its transformers config."""
    name = getattr(config, "name_or_path", "") or config.model_type
    return dims_of_config(config, name, "the benchmark's base model")


def curve_value(curve: dict[int, float], step: float) -> float:
    """Eval loss at `step` (fractional) by linear interpolation between checkpoints."""
    points = sorted(curve.items())
    if step >= points[-1][0]:
        return points[-1][1]
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return points[0][1]


def equal_wall_clock(
    runs: dict[str, dict],
    dims: ModelDims,
    shape: Shape,
    stages: int,
    steps: int,
    device: str = DEVICE,
    link_mbit: float = LINK_MBIT,
) -> dict:
    """Per row: modelled seconds per step (compute, link, step) and its eval loss against dense's
    at the same wall clock. Needs the `dense` row with its `eval_curve`."""
    dense = runs.get("dense")
    if not dense or "eval_curve" not in dense:
        return {}
    dev = DEVICES[device]
    c = gpu_compute(dims, shape, stages, dev, DEFAULT_MFU)
    compute = max(shape.micro_batches * (f + b) + o for f, b, o in zip(c.fwd, c.bwd, c.opt))
    rate = link_mbit * 1e6 / 8

    def step_s(r: dict) -> tuple[float, float]:
        link = r["pp_bytes_per_token"] * shape.tokens * shape.micro_batches / rate
        return link, max(compute, link)

    _, t_dense = step_s(dense)
    curve = {int(k): v for k, v in dense["eval_curve"].items()}
    out = {
        "device": dev.label,
        "mfu": DEFAULT_MFU,
        "link_mbit": link_mbit,
        "compute_s_per_step": compute,
        "model": __doc__.split("\n\n")[1].replace("\n", " "),
        "rows": {},
    }
    for name, r in runs.items():
        if r.get("dp_bytes_per_step"):  # DP rows: another link (the group's) and another clock; not modelled here
            continue
        link, t = step_s(r)
        dense_steps = steps * t / t_dense
        dense_loss = curve_value(curve, dense_steps)
        out["rows"][name] = {
            "link_s_per_step": link,
            "step_s": t,
            "dense_steps_in_same_time": dense_steps,
            "dense_eval_loss_then": dense_loss,
            "vs_dense_same_time": r["eval_loss"] / dense_loss,
        }
    return out


MODELLED_SEQ = 2048  # a practitioner's sequence length, for the bytes a row's codec sends per token


def long_sequence_bytes(cfg, dims: ModelDims) -> float | None:
    """Stream bytes per token of the row's codec on one micro-batch of one MODELLED_SEQ-token
    sequence (activation + gradient, built by the app's encoder as `bench project` sizes them).
    Why: a codec's fixed costs per sequence (the dense sink position) and per message (each
    message's statistics) weigh on the quick run's 64-token sequences and not at a real length.
    Not measured in the run; None for the element mask at drop > 0 (its bytes depend on the draw)."""
    if cfg.mask.scheme == "mask" and cfg.mask.drop:
        return None
    b = mask_message_bytes(cfg.mask, dims, Shape(1, MODELLED_SEQ, 1))
    return (b.activation + b.gradient) / MODELLED_SEQ
