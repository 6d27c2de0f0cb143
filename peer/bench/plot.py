"""`anchormesh bench plot`: projected tokens/s against link bandwidth (25-1000 Mbit/s, log) for the
throughput bench's four modes, with measured points of a `bench throughput` run overlaid.

Why: one picture of where each mode is link-, DP- or compute-bound for a real model on a real
GPU (default: Llama-3.2-1B on an RTX 4090, as in throughput.py's GPU scenario), and of where the
CPU test bed's measurements fall on it.

Measured points come from a tiny model on CPUs, so they are placed with the bench's own
GPU-equivalent rule (the dense link-time / compute-time ratio is kept): a CPU-bed bandwidth b
stands for b * (hidden_gpu / hidden_cpu) * (cb_gpu / cb_cpu), and its tokens/s for
tokens/s * cb_gpu / cb_cpu, where cb = compute_bound tokens/s (projected for the GPU, measured on
the bed). The measured compute_bound is the calibration point itself, so it is not drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

from peer.bench import project as P
from peer.bench.project_args import check_args
from peer.bench.project_costs import measure_costs
from peer.bench.project_model import DEFAULT_MFU, resolve_model
from peer.bench.throughput_modes import mode_config
from peer.errors import ConfigError

STYLE = {
    "dense_sync": "tab:purple",
    "dense": "tab:red",
    "masked": "tab:blue",
    "masked_dp": "tab:green",
    "compute_bound": "tab:gray",
}


def _matplotlib():
    """pyplot on the Agg backend, or a ConfigError naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("bench plot", "matplotlib", "not installed: pip install 'anchormesh[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load_measured(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError("--in", str(path), f"cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError("--in", str(path), f"not JSON: {exc}") from None
    modes = data.get("modes") if isinstance(data, dict) else None
    if (
        not isinstance(modes, dict)
        or "compute_bound" not in modes
        or not isinstance(data.get("setup"), dict)
        or not data["setup"].get("bandwidth_mbit")
    ):
        raise ConfigError(
            "--in",
            str(path),
            "not a `bench throughput` result with a compute_bound mode (needed to scale the points)",
        )
    return data


def plot(
    out: Path,
    measured: Path | None = None,
    model: str = "llama-3.2-1b",
    gpu: str = "rtx4090",
    points: int = 24,
    lo_mbit: float = 25.0,
    hi_mbit: float = 1000.0,
):
    """Render the plot to `out` (a .png) and return the matplotlib Figure."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ConfigError("--out", str(out), "must end in .png")
    data = _load_measured(measured) if measured is not None else None
    setup = data["setup"] if data else {}
    stages, replicas = int(setup.get("stages", 2)), int(setup.get("replicas", 2))
    device = check_args(gpu, hi_mbit, stages, replicas, None, int(setup.get("dp_every", 10)))
    dims, shape, source = resolve_model(model, stages)
    plt = _matplotlib()
    mfu = None if device.peak_tflops is None else DEFAULT_MFU
    dp_every = int(setup.get("dp_every", 10))  # the measured run's masked_dp cadence, else the full bench's
    costs = measure_costs(dims, shape, stages, replicas, device, mfu, dp_every)
    xs = [lo_mbit * (hi_mbit / lo_mbit) ** (i / (points - 1)) for i in range(points)]
    proj = {m: [P.project_mode(costs, m, x) for x in xs] for m in P.PROJECT_MODES}

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    width = {
        "masked": 5,
        "masked_dp": 1.8,
    }  # masked and masked_dp often coincide: the wide one shows under the narrow one
    for m in P.PROJECT_MODES:
        ls = "--" if m == "compute_bound" else "-." if m == P.SYNC else "-"
        ax.plot(
            xs,
            [r["tokens_per_s"] for r in proj[m]],
            color=STYLE[m],
            lw=width.get(m, 2),
            alpha=0.5 if m == "masked" else 1.0,
            ls=ls,
            label=f"{m} (projected)",
        )
    for m in ("dense", "masked", "masked_dp"):  # the same mode if DP had to keep its cadence
        kept = [r["dp_kept"]["tokens_per_s"] for r in proj[m]]
        if any(abs(k / r["tokens_per_s"] - 1) > 0.01 for k, r in zip(kept, proj[m])):
            ax.plot(
                xs,
                kept,
                color=STYLE[m],
                lw=1,
                ls=":",
                label=f"{m}, DP kept at every {proj[m][0]['dp']['inner_steps']} step(s)",
            )
    if data:
        cb_gpu = proj["compute_bound"][0]["tokens_per_s"]
        cb_cpu = data["modes"]["compute_bound"]["tokens_per_s"]
        hidden_cpu = (setup.get("model") or {}).get(
            "hidden", mode_config("dense", stages, 1, 1)["model"]["hidden_size"]
        )
        speed = cb_gpu / cb_cpu
        for m, r in data["modes"].items():
            if m not in STYLE or m == "compute_bound" or not r.get("tokens_per_s"):
                continue  # compute_bound is unshaped, and on its line by construction
            bw = r.get("rate_mbit") or setup["bandwidth_mbit"]
            x = bw * dims.hidden / hidden_cpu * speed
            ax.plot(
                [x],
                [r["tokens_per_s"] * speed],
                ls="none",
                marker="o",
                ms=8,
                mfc="white",
                mec=STYLE[m],
                mew=2,
                label=f"{m} measured (CPU bed, scaled)",
            )
    for m in ("dense", "masked", "masked_dp"):
        ax2.plot(
            xs,
            [r["dp_every_achieved"] for r in proj[m]],
            color=STYLE[m],
            lw=width.get(m, 2),
            alpha=0.5 if m == "masked" else 1.0,
            label=f"{m}: steps per DP round",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax2.set_yscale("log")
    ax.set_xlim(lo_mbit, hi_mbit)
    ticks = [t for t in (25, 50, 100, 200, 500, 1000) if lo_mbit <= t <= hi_mbit]
    ax2.set_xticks(ticks, [str(t) for t in ticks])
    ax2.set_xticks([], minor=True)
    ax2.set_xlabel("link bandwidth per host, each way (Mbit/s)")
    ax.set_ylabel("tokens/s (all stage-0 peers)")
    ax2.set_ylabel("steps per DP round\n(achieved)")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7, loc="upper right")
    where = device.label if device.peak_tflops is None else f"{device.label} at {mfu:.0%} MFU"
    ax.set_title(
        f"{dims.name} on {where}, {stages} stages x {replicas} peers, micro-batch {shape.micro_batch_size}x{shape.seq_len} x{shape.micro_batches}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.text(
        0.01,
        0.005,
        "projection: peer/bench/project.py (the app's schedule simulated; DP rounds run in the background, as often as half the link allows; dotted: DP must keep its cadence)",
        fontsize=6,
        alpha=0.7,
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return fig
