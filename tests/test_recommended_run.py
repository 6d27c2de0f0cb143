"""One recommended run, in one place: the config dataclasses' defaults are it; a run.toml naming
only its model gets exactly it; the tiny models depart only where TINY_RUN says; the demo, the
bootstrap without --config, the benchmark's default row and the examples are built from it; and
`anchormesh config show|check` and `--set` say what will run before anything starts."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from peer.config import (
    LOCAL_ONLY,
    TINY_RUN,
    AnchorConfig,
    ConfigError,
    MaskConfig,
    ModelConfig,
    PipelineConfig,
    SpectralConfig,
    TrainConfig,
    codec_key,
)
from peer.runtoml import DEFAULT, FILE, SET, TINY, config_digest, load_run, resolve_run

ROOT = Path(__file__).resolve().parents[1]
REAL = "smollm2-135m"  # the name alone: resolving it needs no model files


def _flat(cfg: TrainConfig) -> dict[str, object]:
    data = dataclasses.asdict(cfg)
    return {
        f"{s}.{k}" if isinstance(v, dict) else s: (v[k] if isinstance(v, dict) else v)
        for s, v in data.items()
        for k in (v if isinstance(v, dict) else [None])
    }


def test_the_defaults_are_the_recommended_run() -> None:
    cfg = TrainConfig()
    assert cfg.mask.scheme == "transform" and (
        cfg.mask.bits,
        cfg.mask.grad_bits,
        cfg.mask.grad_rounding,
        cfg.mask.act_stats,
    ) == (2.0, 1.0, "dither", "message")
    assert (cfg.pipeline.max_staleness, cfg.pipeline.staleness_correction) == (1, "lookahead")
    assert not cfg.anchor.enabled and cfg.spectral.mode == "off" and cfg.optim.lr == 1e-4


def test_a_run_toml_naming_only_its_model_runs_exactly_the_defaults() -> None:
    resolved = resolve_run({"model": {"name": REAL}})
    assert resolved.config == TrainConfig(model=ModelConfig(name=REAL))
    assert {k: v for k, v in resolved.sources.items() if v != DEFAULT} == {"model.name": FILE}


def test_the_tiny_run_departs_from_the_defaults_only_where_tiny_run_says() -> None:
    tiny = resolve_run()
    declared = {f"{s}.{k}" for s, kv in TINY_RUN.items() for k in kv}
    changed = {k for k, v in _flat(tiny.config).items() if _flat(TrainConfig())[k] != v}
    assert changed == declared
    assert {k for k, v in tiny.sources.items() if v == TINY} == {
        codec_key(k.split(".")[1], "transform") if k.startswith("mask.") else k for k in declared
    }
    # a run.toml's own value wins over the profile; the profile's codec settings apply to its codec only
    assert resolve_run({"codec": {"transform": {"grad_bits": 1.0}}}).config.mask.grad_bits == 1.0
    lowrank = resolve_run({"codec": {"scheme": "lowrank"}})
    assert (
        lowrank.config.mask.grad_bits == MaskConfig().grad_bits and "codec.transform.grad_bits" not in lowrank.sources
    )


def test_the_demo_the_bootstrap_and_the_bench_default_row_are_built_from_the_defaults() -> None:
    from bootstrap.node import default_run
    from peer.bench import quality
    from peer.demo.local import demo_config
    from peer.demo.swarm import DEMO_CPU_SIZES, model_run_toml

    assert default_run() == resolve_run().config
    assert (
        demo_config(2, "transform", 0.95, 20).mask == default_run().mask
        and not demo_config(2, "transform", 0.95, 20).anchor.enabled
    )
    demo = resolve_run(tomllib.loads(model_run_toml(REAL)))
    departs = {k for k, v in demo.sources.items() if v != DEFAULT}
    assert departs == {"model.name", "model.num_stages"} | {f"{s}.{k}" for s, kv in DEMO_CPU_SIZES.items() for k in kv}
    for setup, model in ((quality.setup_for(True), "tiny-llama"), (quality.setup_for(True, REAL), REAL)):
        row = quality.rows(setup)[quality.DEFAULT_ROW]
        rec = resolve_run({"model": {"name": model}}).config
        assert row.mask == rec.mask and row.anchor == rec.anchor and row.spectral == rec.spectral
        assert (row.pipeline.max_staleness, row.pipeline.staleness_correction) == (
            rec.pipeline.max_staleness,
            rec.pipeline.staleness_correction,
        )
    assert quality.rows(quality.setup_for(True))["dense"].mask == MaskConfig(
        scheme="mask"
    )  # the baseline stays dense and synchronous
    assert quality.rows(quality.setup_for(True))["dense"].pipeline.max_staleness == 0


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_the_examples_run_the_recommended_codec_and_say_where_they_depart(path: Path) -> None:
    resolved = load_run(str(path))
    text = path.read_text()
    rec = TrainConfig()
    assert (
        resolved.config.mask.scheme == rec.mask.scheme
        and resolved.config.anchor == AnchorConfig()
        and resolved.config.spectral == SpectralConfig()
    )
    assert resolved.config.pipeline.max_staleness == rec.pipeline.max_staleness
    for name, source in resolved.sources.items():  # every codec, optimizer or DP departure carries its reason
        if source == FILE and name.split(".")[0] in ("codec", "optim", "dp") and name not in ("optim.weight_decay",):
            line = next(line for line in text.splitlines() if line.strip().startswith(name.rsplit(".", 1)[1] + " "))
            assert "departs from the default" in line, line


def test_settings_a_swarm_does_not_read_are_refused_with_what_it_reads() -> None:
    assert "steps" in LOCAL_ONLY and "dp.scheme" in LOCAL_ONLY
    with pytest.raises(
        ConfigError,
        match=r"dp.scheme.*does not read.*\[dp\] settings a swarm reads: inner_steps, outer_compression, link_share, min_period_s",
    ):
        resolve_run({"dp": {"scheme": "powersgd"}})
    with pytest.raises(ConfigError, match=r"steps.*top-level settings a swarm reads: seed, token_budget"):
        resolve_run({"steps": 10})
    with pytest.raises(ConfigError, match=r"anchor.executor.*\(--set\)"):
        resolve_run(sets=["anchor.executor=thread"])


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["optim.lr=abc"], "optim.lr='abc': must be a number"),
        (["optim.lrr=1"], "optim.lrr=1: unknown setting; known: beta1"),
        (["colour.x=1"], "colour"),
        (["optim.lr"], "must be section.key=value"),
        (["=3"], "must be section.key=value"),
        (["codec.scheme=zip"], "codec.scheme='zip': must be one of mask, lowrank, transform"),
        (["mask.bits=3"], "mask.bits=3: [mask] is now [codec]: bits goes under [codec.transform]"),
        (
            ["codec.lowrank.rank=4"],
            "codec.lowrank.rank=4: (--set) a setting of the lowrank codec, but codec.scheme = 'transform'",
        ),
        (["pipeline.seq_len=2.5"], "pipeline.seq_len=2.5: must be an integer"),
    ],
)
def test_bad_set_overrides_name_the_key_and_what_is_allowed(sets: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)):
        resolve_run(sets=sets)


def test_set_overrides_win_and_numbers_are_one_run_however_written() -> None:
    resolved = resolve_run(
        {"optim": {"lr": 3e-4}}, ["optim.lr=2e-4", "model.name=smollm2-135m", "codec.transform.bits=3"]
    )
    assert (
        resolved.config.optim.lr == 2e-4
        and resolved.config.mask.bits == 3.0
        and isinstance(resolved.config.mask.bits, float)
    )
    assert resolved.sources["optim.lr"] == SET and resolved.sources["model.name"] == SET
    assert config_digest(resolve_run({"codec": {"transform": {"bits": 3}}}).config) == config_digest(
        resolve_run({"codec": {"transform": {"bits": 3.0}}}).config
    )
    assert config_digest(resolve_run().config) != config_digest(resolve_run(sets=["seed=1"]).config)


def test_config_show_prints_a_run_toml_of_the_same_run_with_each_value_s_source(capsys: pytest.CaptureFixture) -> None:
    from peer.cli import main

    main(["config", "show", "--set", f"model.name={REAL}", "--set", "optim.lr=3e-4"])
    out = capsys.readouterr().out
    assert (
        'name = "smollm2-135m"' in out
        and "# --set" in out.splitlines()[[i for i, line in enumerate(out.splitlines()) if line.startswith("lr =")][0]]
    )
    again = resolve_run(tomllib.loads(out))  # what it prints is a run.toml of the same run
    assert (
        config_digest(again.config)
        == config_digest(resolve_run(sets=[f"model.name={REAL}", "optim.lr=3e-4"]).config)
        == out.split()[3].rstrip(":")
    )
    assert not any(
        line.startswith(("steps =", "executor =")) for line in out.splitlines()
    )  # nothing a run.toml may not set


def test_config_check_validates_as_the_bootstrap_does_and_bad_configs_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from peer.cli import main

    main(["config", "check"])
    assert capsys.readouterr().out.startswith(f"ok: run config {config_digest(resolve_run().config)}")
    bad = tmp_path / "run.toml"
    for text, named in (
        (
            '[codec]\nscheme = "mask"\n[codec.mask]\ndrop = 0.9\n[anchor]\nevery = 5\n[spectral]\nmode = "ef"\n',
            "spectral.mode",
        ),
        ("[model]\nnum_stages = 9\n", "num_stages"),
        ("[dp]\nscheme = 'dense'\n", "dp.scheme"),
    ):
        bad.write_text(text)
        for argv in (
            ["config", "check", "--config", str(bad)],
            ["bootstrap", "--config", str(bad), "--state-dir", str(tmp_path / "boot")],
        ):
            with pytest.raises(SystemExit) as exc:
                main(argv)
            err = capsys.readouterr().err
            assert exc.value.code == 2 and named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "boot").exists()  # refused before anything started


def test_the_tracker_status_names_the_run_config_and_wire_version() -> None:
    from bootstrap.tracker import Tracker
    from peer.wire.version import wire_version

    cfg = resolve_run().config
    status = Tracker("run-x", cfg).status()
    assert (
        status.config_digest == config_digest(cfg)
        and status.wire_version == wire_version()
        and wire_version().startswith("w")
    )


def test_pipeline_defaults_match_the_tiny_run_sizes() -> None:
    """The swarm's tiny run keeps its measured sizes: 8 x 2 micro-batches of 128 tokens."""
    p = resolve_run().config.pipeline
    assert (p.micro_batch_size, p.micro_batches, p.seq_len) == (PipelineConfig().micro_batch_size, 2, 128)


def test_the_operator_guide_marks_exactly_the_settings_a_swarm_does_not_read() -> None:

    text = (ROOT / "docs" / "operator.md").read_text()
    marked = set()
    section = ""
    for line in text.splitlines():
        if m := re.match(r"### `\[(\w+)\]`", line):
            section = m.group(1)
        elif line.startswith("### Top level"):
            section = ""
        elif "local runner only" in line and (m := re.match(r"\| `(\w+)` \|", line)):
            marked.add(f"{section}.{m.group(1)}" if section else m.group(1))
    assert marked == LOCAL_ONLY
