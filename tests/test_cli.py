"""The console entry point: the demo runs and summarises; bad flags exit 2 with the field named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


@pytest.mark.processes
@pytest.mark.parametrize("codec", ["transform", "lowrank", "mask"])
def test_demo_trains_and_prints_a_summary(codec: str) -> None:
    out = _cli("demo", "--local", "--seconds", "4", "--threads", "1", "--codec", codec)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = [line for line in out.stdout.splitlines() if line.startswith("summary:")]
    assert summary, out.stdout[-2000:]
    assert "tok/s" in summary[0] and "B/token" in summary[0] and "held-out loss" in summary[0]


@pytest.mark.processes
@pytest.mark.parametrize(
    "args,field",
    [
        (["demo", "--local", "--codec", "mask", "--drop", "1.5"], "mask.drop=1.5"),
        (["demo", "--local", "--stages", "9"], "model.num_stages=9"),
        (["demo", "--local", "--codec", "lowrank", "--rank", "0"], "lowrank.rank=0"),
    ],
)
def test_bad_values_exit_2_naming_the_field(args: list[str], field: str) -> None:
    out = _cli(*args)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert field in out.stderr and "Traceback" not in out.stderr


@pytest.mark.processes
def test_unknown_flag_exits_2() -> None:
    out = _cli("demo", "--no-such-flag")
    assert out.returncode == 2 and "--no-such-flag" in out.stderr


@pytest.mark.processes
def test_swarm_demo_trains_and_stops_every_process() -> None:
    """`--seconds` counts from the first step (startup on a busy machine once took a whole 45 s
    window: step 0); the summary says how long startup took."""
    out = _cli("demo", "--peers", "2", "--seconds", "20", timeout=420)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("summary:")][-1]
    assert "every process stopped" in line and '"processes_left": []' in line
    summary = json.loads(line[len("summary: ") : line.index("; every")])
    assert summary["step"] > 0 and summary["loss"] is not None and 0 < summary["startup_s"] < 180
    assert (
        summary["data"]["position"] > 0 and summary["data"]["tokens_seen"] > 0
    )  # the built-in corpus, prepared by the bootstrap
    assert any(
        x.startswith("data epoch 0, window ") for x in out.stdout.splitlines()
    )  # the status table shows the position
    assert any(x.startswith("first step ") and x.endswith(" s after launch") for x in out.stdout.splitlines())


@pytest.mark.processes
def test_bootstrap_with_a_bad_run_toml_exits_2_naming_the_field(tmp_path) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text('[codec]\nscheme = "mask"\n[codec.mask]\ndrop = 0.9\nkeep_ratio = 3\n')
    out = _cli("bootstrap", "--config", str(bad), "--state-dir", str(tmp_path / "boot"))
    assert out.returncode == 2 and "codec.mask.keep_ratio=3: not a setting of the mask codec" in out.stderr
    assert not (tmp_path / "boot" / "bootstrap.json").exists()


def test_run_toml_round_trips_into_the_config(tmp_path) -> None:
    from peer.runtoml import load_run_toml

    path = tmp_path / "run.toml"
    path.write_text(
        'seed = 50\n[model]\nnum_stages = 3\n[codec]\nscheme = "lowrank"\n[codec.lowrank]\nrank = 12\n[dp]\ninner_steps = 20\n'
    )
    cfg = load_run_toml(str(path))
    assert (cfg.seed, cfg.model.num_stages, cfg.mask.scheme, cfg.mask.rank, cfg.dp.inner_steps) == (
        50,
        3,
        "lowrank",
        12,
        20,
    )


@pytest.mark.processes
def test_bootstrap_refuses_a_config_the_swarm_cannot_run(tmp_path) -> None:
    bad = tmp_path / "run.toml"
    bad.write_text('[anchor]\nevery = 5\n[spectral]\nmode = "ef"\n')
    out = _cli("bootstrap", "--config", str(bad), "--state-dir", str(tmp_path / "boot"))
    assert out.returncode == 2 and "spectral.mode='ef'" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "boot" / "bootstrap.json").exists()


@pytest.mark.processes
@pytest.mark.parametrize(
    "device,says",
    [
        ("cuda", "no CUDA device is visible"),
        ("cuda:3", "no CUDA device is visible"),
        ("gpu", "must be auto, cpu, cuda or cuda:N"),
        ("cuda:x", "cuda:N"),
    ],
)
def test_peer_device_that_is_not_here_exits_2_with_the_fix(device: str, says: str) -> None:
    """No GPU here (CI has none): asking for one exits 2 before any process starts, with the
    reason, no traceback (after the light checks: whether a GPU is visible needs torch)."""
    out = _cli("peer", "--tracker", "127.0.0.1:9", "--token", "a-run-token-of-24-chars!", "--device", device)
    assert (
        out.returncode == 2
        and f"--device={device!r}" in out.stderr
        and says in out.stderr
        and "Traceback" not in out.stderr
    )


@pytest.mark.parametrize(
    "flags,field",
    [
        (["--stages", "1"], "--stages"),
        (["--replicas", "0"], "--replicas"),
        (["--bandwidth-mbit", "-3"], "--bandwidth-mbit"),
        (["--modes", "fast"], "--modes"),
        (["--repeat", "0"], "--repeat"),
        (["--max-staleness", "-1"], "--max-staleness"),
        (["--steps", "12"], "--steps"),
    ],
)
def test_bench_throughput_bad_flags_exit_2(flags: list[str], field: str, tmp_path, capsys) -> None:
    from peer.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--out", str(tmp_path / "out.json"), *flags])
    assert exc.value.code == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
