"""The `[codec]` section: the pipeline-link codec's scheme and every codec's settings.

Its own module because it is the largest section: `MaskConfig`'s docstring is the reference for
every codec setting, and `CODEC_SHARED` / `CODEC_SETTINGS` say how they appear in a run.toml.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.config.checks import choice, positive
from peer.errors import ConfigError

MASK_FILLS = ("zero", "token_prior", "rescale", "prior_rescale")
VALUE_DTYPES = ("fp32", "fp16", "bf16", "int8")


GRAD_ROUNDINGS = ("stochastic", "dither", "nearest")
GRAD_ROTATIONS = ("fixed", "message")
ACT_ROUNDINGS = ("nearest", "dither")
ACT_STATS = ("coder", "message")
GRAD_RATES = ("even", "row")
MASK_SCHEMES = ["mask", "lowrank", "transform"]  # a list: peer/pipeline/codecs register() adds to it

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
        grad_rotation: scheme "transform": "fixed" (the default: the run's rotation alone) or
            "message" (each message's rows signed and permuted by its key before the run's
            rotation, so a value-dependent error, a clip or a nearest rounding, differs from
            message to message). Through a fixed rotation the 1-bit dither's clip (+-0.8 sigma at
            step scale 1) is the same function of the gradient in every message, and its bias
            adds up over steps along directions the gradient lacks: on the tiny model at lr 2e-3
            a vector common to every row of stage 0's output (which the next stage's RMSNorm
            leaves nearly free) grew without bound (RMS 2.4 to 3e4 in 150 steps, 3e5 in 300; loss
            3.0 against dense's 2.0); per message it stayed at dense's. SmolLM2-135M shows no such
            growth, and there "message" trained worse (domain adaptation, 200 steps, one seed:
            +0.55 % over dense against +0.23 %, step deficit 12.5 % against 6.1 %), so the
            recommended run keeps "fixed"; the test bed's tiny-model runs take "message".
            "nearest" rounding is meant with "message" (its error is the same for the same value).
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
            the rotation each time (its rows signed and permuted by its key). Default 1: on
            SmolLM2-135M (domain adaptation, 200 steps, one seed) half a bit per value ended
            +1.22 % over dense on the confirmation split against +0.76 % at one bit, its step
            deficit 20 % against 6 % (docs/benchmarks.md): over the 1 % budget.
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
        choice(self._key("scheme"), self.scheme, MASK_SCHEMES)
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
        choice(self._key("grad_rounding"), self.grad_rounding, GRAD_ROUNDINGS)
        choice(self._key("act_rounding"), self.act_rounding, ACT_ROUNDINGS)
        choice(self._key("act_stats"), self.act_stats, ACT_STATS)
        choice(self._key("grad_rates"), self.grad_rates, GRAD_RATES)
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
        choice(self._key("grad_rotation"), self.grad_rotation, GRAD_ROTATIONS)
        if not (0.25 <= self.grad_step_scale <= 8.0):
            raise ConfigError(
                self._key("grad_step_scale"), self.grad_step_scale, "must be in [0.25, 8] Gaussian-optimal steps"
            )
        positive(self._key("rank"), self.rank)
        positive(self._key("basis_refresh"), self.basis_refresh)
        if not (0.0 <= self.drop < 1.0):
            raise ConfigError(
                self._key("drop"), self.drop, "keep fraction 1-drop must be in (0, 1]: need 0 <= drop < 1"
            )
        choice(self._key("fill"), self.fill, MASK_FILLS)
        choice(self._key("values"), self.values, VALUE_DTYPES)
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
