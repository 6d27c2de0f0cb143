"""`anchormesh bench quality --model`: a pretrained model (here a tiny one saved as a local
folder with its own tokenizer, as a hub model would be) is the base every row adapts, with no
pretraining inside the benchmark, its own tokenizer, and the swarm's default row named."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from peer.bench import quality, quality_corpora
from peer.bench.quality_corpora import documents
from peer.config import ModelConfig
from peer.errors import ConfigError


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peer.model.loading import load_causal_lm
    from peer.model.tokenizer import hf_byte_tokenizer

    out = tmp_path_factory.mktemp("pretrained")
    model = load_causal_lm(
        ModelConfig(name="tiny-llama", hidden_size=64, num_layers=2, num_heads=4, max_seq_len=128), seed=3
    )
    model.save_pretrained(out)
    hf_byte_tokenizer(128).save_pretrained(out)
    return out


@pytest.mark.slow
def test_a_pretrained_model_is_the_base_of_every_row(pretrained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = quality.setup_for
    monkeypatch.setattr(
        quality, "setup_for", lambda quick, model=None: replace(real(quick, model), adapt_steps=4, eval_batches=2)
    )
    torch.manual_seed(0)
    out = quality.run_quality(True, None, None, only=["dense", "lowrank", "transform"], model=str(pretrained))
    setup = out["setup"]
    assert setup["pretrain_steps"] == 0 and setup["tokenizer"] == "model" and setup["model"]["hidden_size"] == 64
    assert setup["lowrank_rank"] == 32 and "lr 0.0001 constant" in setup["optimizer"]
    assert (setup["device"], setup["compute_dtype"]) == ("cpu", "fp32")
    assert out["default_row"] == quality.DEFAULT_ROW and set(out["runs"]) == {"dense", "lowrank", "transform"}
    dense, lowrank, transform = out["runs"]["dense"], out["runs"]["lowrank"], out["runs"]["transform"]
    assert dense["eval_loss"] != out["pretrained"]["eval_loss"]  # the rows train the base
    assert lowrank["pp_bytes_per_token"] < dense["pp_bytes_per_token"] / 2
    assert out["vs_dense"]["lowrank"]["pp_bytes_reduction"] > 2
    assert all(
        r["rss_gb_after"] is not None and 0 < r["rss_gb_after"] < 64 for r in (dense, lowrank)
    )  # memory after each row (Linux)
    # the transform coder: fewer stream bytes than dense; its shipped coders counted apart
    assert (
        0 < transform["pp_state_bytes_per_token"]
        and transform["pp_stream_bytes_per_token"] < dense["pp_stream_bytes_per_token"] / 2
    )
    assert dense["pp_state_bytes_per_token"] == 0 and transform["eval_loss"] == transform["eval_loss"]
    # at a practitioner's sequence length (sized by the app's encoder, not measured): dense costs
    # what it cost in the run (its bytes scale with tokens), the transform coder less than in the
    # run's short sequences (its dense sink position and per-message statistics amortise)
    assert dense["pp_bytes_per_token_modelled"] == pytest.approx(dense["pp_stream_bytes_per_token"], rel=0.05)
    assert transform["pp_bytes_per_token_modelled"] < transform["pp_stream_bytes_per_token"]
    assert (
        out["vs_dense"]["transform"]["pp_bytes_reduction_modelled"]
        > out["vs_dense"]["transform"]["pp_stream_bytes_reduction"]
    )
    # measured at the run's own length, with the coders: what crossed the links, not less
    assert (
        transform["seq_len"] == out["setup"]["seq_len"]
        and transform["pp_bytes_per_token"] > transform["pp_stream_bytes_per_token"]
    )
    # equal wall clock: dense's eval curve from the base (step 0) to its last step; a row that
    # sends fewer bytes per step makes dense look worse at the same time, never better
    assert set(dense["eval_curve"]) == {0, 1, 2, 3, 4} and dense["eval_curve"][4] == dense["eval_loss"]
    clock = out["equal_wall_clock"]["rows"]
    assert clock["dense"]["vs_dense_same_time"] == pytest.approx(1.0)
    assert clock["transform"]["link_s_per_step"] < clock["dense"]["link_s_per_step"]
    assert clock["transform"]["dense_steps_in_same_time"] <= 4
    # steps-to-target: dense against itself has no deficit; every row is evaluated along the run
    assert out["vs_dense"]["dense"]["step_deficit"] == 0.0
    assert set(transform["eval_curve"]) == {0, 1, 2, 3, 4} and set(out["vs_dense"]["transform"]["gap_at"]) == {
        1,
        2,
        3,
        4,
    }
    deficit = out["vs_dense"]["transform"]["step_deficit"]
    assert deficit is None or -1 <= deficit <= 1  # None: the row ended below dense's best; < 0: below its end


def test_quick_runs_the_issue_rows_and_rows_are_checked_before_any_model_loads() -> None:
    table = quality.rows(quality.setup_for(True))
    assert set(quality.QUICK_ROWS) <= set(table) and quality.DEFAULT_ROW in quality.QUICK_ROWS
    assert quality.chosen_rows(True, None) == list(quality.QUICK_ROWS)
    assert quality.chosen_rows(False, None) is None and quality.chosen_rows(True, ["all"]) is None
    assert quality.chosen_rows(True, ["dense"]) == ["dense"]
    with pytest.raises(quality.ConfigError, match="unknown row.*dense_sync"):
        quality.run_quality(True, None, None, only=["dense", "dense_sync"])  # the toy, before its pretraining


def test_a_schedule_applies_to_every_row_and_is_stated() -> None:
    setup = replace(quality.setup_for(True), schedule="cosine", adapt_lr=2e-4)
    table = quality.rows(setup)
    assert {cfg.optim.schedule for cfg in table.values()} == {"cosine"}
    o = table["transform"].optim
    assert (o.lr, o.warmup_steps, o.decay_steps) == (2e-4, setup.adapt_steps // 10, setup.adapt_steps)
    assert "cosine to 0.1 x lr at step 120, warmup 12 steps" in quality._describe(o)
    assert quality.rows(quality.setup_for(True))["dense"].optim.schedule == "constant"
    with pytest.raises(ConfigError, match="optim.lr"):
        quality.run_quality(True, None, None, only=["dense"], lr=-1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_device_that_is_not_here_is_refused_before_any_model_loads() -> None:
    """`--device cuda` without a GPU: the reason and the fix, before the toy pretrains."""
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        quality.run_quality(True, None, None, only=["dense"], device="cuda")
    with pytest.raises(ConfigError, match="must be auto, cpu, cuda"):
        quality.run_quality(True, None, None, only=["dense"], device="tpu")


@pytest.mark.slow
def test_continual_pretraining_trains_on_the_general_text(
    pretrained: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--task continual: the corpora swap roles (the rows train on the general text, eval on its
    held-out part; the domain text is the other eval); the toy is refused before anything loads."""
    real = quality.setup_for
    monkeypatch.setattr(
        quality, "setup_for", lambda quick, model=None: replace(real(quick, model), adapt_steps=2, eval_batches=1)
    )
    monkeypatch.setattr(
        quality_corpora, "PROSE_DIR", tmp_path / "no-prose"
    )  # this machine's licence texts, whatever is cached
    general, domain = documents("a", None)[1], documents("b", None)[1]
    adapt = quality.run_quality(True, None, None, only=["dense"], model=str(pretrained))
    with pytest.raises(ConfigError, match="continual pretraining needs 5,000,000 bytes of general prose"):
        quality.run_quality(True, None, None, only=["dense"], model=str(pretrained), task="continual")
    monkeypatch.setattr(quality_corpora, "PROSE_MIN_BYTES", 10_000)  # this machine's licence texts stand in
    cont = quality.run_quality(True, None, None, only=["dense"], model=str(pretrained), task="continual")
    assert (adapt["setup"]["task"], adapt["setup"]["corpus_b"], adapt["setup"]["corpus_a"]) == (
        "adapt",
        domain,
        general,
    )
    assert (cont["setup"]["task"], cont["setup"]["corpus_b"], cont["setup"]["corpus_a"]) == (
        "continual",
        general,
        domain,
    )
    # the same base evaluated on swapped held-out sets
    assert cont["pretrained"]["eval_loss"] == pytest.approx(adapt["pretrained"]["eval_loss_a"])
    with pytest.raises(ConfigError, match="needs a pretrained model"):
        quality.run_quality(True, None, None, only=["dense"], task="continual")
    with pytest.raises(ConfigError, match="--task"):
        quality.run_quality(True, None, None, only=["dense"], model=str(pretrained), task="pretrain")


def test_longer_runs_and_bigger_steps_are_set_and_checked_before_any_model_loads() -> None:
    base = quality.setup_for(True)
    longer = quality.scaled_setup(base, 200, 4 * base.micro_batch_size * base.seq_len)
    assert (longer.adapt_steps, longer.micro_batches) == (200, 4)
    assert longer.micro_batch_size * longer.micro_batches * longer.seq_len == 4 * base.micro_batch_size * base.seq_len
    with pytest.raises(ConfigError, match="--steps"):
        quality.run_quality(True, None, None, only=["dense"], steps=3)
    with pytest.raises(ConfigError, match="--tokens-per-step.*multiple of"):
        quality.run_quality(True, None, None, only=["dense"], tokens_per_step=base.seq_len + 1)


def test_a_replicate_seed_redraws_the_codec_unless_set_apart() -> None:
    from peer.bench.quality_rows import rows

    setup = quality.setup_for(True)
    assert rows(replace(setup, seed=5))["transform"].mask.seed == 5
    assert rows(replace(setup, seed=5, codec_seed=0))["transform"].mask.seed == 0


def test_the_gpu_suite_is_refused_where_it_cannot_run_before_anything_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from peer.cli import main

    for extra, says in (
        (["--device", "cpu"], "--gpu-suite='cpu': needs a CUDA device"),
        (["--device", "cpu", "--quick", "--steps", "100"], "drop --quick, --steps"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["bench", "quality", "--gpu-suite", "--out", str(tmp_path / "x.json"), *extra])
        assert exc.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_a_held_row_sends_its_gradients_at_their_floor_and_nothing_else_changes(
    pretrained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = quality.setup_for
    monkeypatch.setattr(
        quality, "setup_for", lambda quick, model=None: replace(real(quick, model), adapt_steps=6, eval_batches=2)
    )
    out = quality.run_quality(
        True, None, None, only=["transform_stale1", "transform_stale1_g05"], model=str(pretrained)
    )
    full, held = out["runs"]["transform_stale1"], out["runs"]["transform_stale1_g05"]
    # the first step's gradients go at the run's bits (no compute time known yet), the next five at half
    assert held["pp_grad_bytes_per_token"] < 0.8 * full["pp_grad_bytes_per_token"]
    # the activations' link is left alone
    fwd = [r["pp_bytes_per_token"] - r["pp_grad_bytes_per_token"] for r in (full, held)]
    assert fwd[1] == pytest.approx(fwd[0], rel=0.02)
