"""`anchormesh doctor`: each check's verdict from fake inputs (peer/doctor/checks.py), then the
real command on this machine, alone and against a tracker (its memory plan of the run)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from peer.doctor import checks
from peer.doctor.checks import FAIL, GIB, MIB, OK, SKIP, WARN
from peer.doctor.run import _bind_error, _disk_free

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "ANCHORMESH_TOKEN": "", "ANCHORMESH_TRACKER": ""}
TOKEN = "doctor-test-token-0123456789"


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "doctor", *args], capture_output=True, text=True, timeout=180, env=ENV
    )


def test_gpu_names_each_card_and_the_driver_and_no_gpu_is_a_warning() -> None:
    c = checks.gpu("NVIDIA GeForce RTX 4090, 550.54.14, 24564\nNVIDIA GeForce RTX 3090, 550.54.14, 24576\n")
    assert c.status == OK and c.detail == (
        "2 GPU: NVIDIA GeForce RTX 4090, 24.0 GiB; NVIDIA GeForce RTX 3090, 24.0 GiB; driver 550.54.14"
    )
    assert checks.gpu(None).status == WARN and "trains on the CPU" in checks.gpu("").detail


def test_torch_build_says_cpu_build_and_a_cuda_build_that_sees_no_device() -> None:
    assert checks.torch_build("2.5.1+cpu", None, False, gpu_seen=False) == checks.Check(
        "torch", OK, "torch 2.5.1+cpu, CPU build (no GPU here)"
    )
    cpu_on_gpu = checks.torch_build("2.5.1+cpu", None, False, gpu_seen=True)
    assert cpu_on_gpu.status == WARN and "CPU build: the GPU goes unused" in cpu_on_gpu.detail
    blind = checks.torch_build("2.5.1+cu124", "12.4", False, gpu_seen=True)
    assert blind.status == FAIL and "CUDA 12.4" in blind.detail and "driver" in blind.detail
    assert checks.torch_build("2.5.1+cu124", "12.4", True, gpu_seen=True).status == OK
    assert checks.torch_build(None, None, False, gpu_seen=False).status == FAIL


def test_shm_docker_default_fails_with_the_fix() -> None:
    c = checks.shm(64 * MIB)
    assert c.status == FAIL and "64 MiB" in c.detail and "--shm-size=1g" in c.detail
    assert checks.shm(512 * MIB).status == WARN
    assert checks.shm(8 * GIB).status == OK
    assert checks.shm(None).status == WARN


def test_ports_a_taken_one_fails_naming_the_flag() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        error = _bind_error("127.0.0.1", taken)
        assert error  # "Address already in use"
        c = checks.port("--grpc-port", "127.0.0.1", taken, error)
        assert c.status == FAIL and c.name == "grpc" and f"--grpc-port {taken} on 127.0.0.1 cannot be bound" in c.detail
    assert _bind_error("127.0.0.1", 0) == ""
    assert checks.port("--dht-port", "0.0.0.0", 31338, "").detail.endswith(
        "forward TCP 31338 to this machine behind NAT"
    )
    assert "any free port" in checks.port("--dht-port", "127.0.0.1", 0, "").detail


def test_clock_skew_bounds_and_skip() -> None:
    assert checks.clock(0.3).status == OK
    assert checks.clock(-5.0) == checks.Check(
        "clock", WARN, "5.0 s behind the tracker: enable NTP (timedatectl set-ntp true)"
    )
    assert checks.clock(120.0).status == FAIL
    assert checks.clock(None, "no --tracker").status == SKIP


def test_disk_thresholds_and_a_state_dir_not_made_yet(tmp_path: Path) -> None:
    assert checks.disk("/x", 200 * MIB).status == FAIL
    assert checks.disk("/x", 5 * GIB).status == WARN
    assert checks.disk("/x", 50 * GIB).status == OK
    assert checks.disk("/x", None).status == FAIL
    assert "no --state-dir" in checks.disk(".", 50 * GIB, given=False).detail
    assert _disk_free(tmp_path / "not" / "yet") > 0  # measured on the nearest existing parent


def test_memory_fits_some_stages_all_or_none() -> None:
    plan = [2 * GIB, 6 * GIB]
    assert checks.memory("cuda:0", plan, 8 * GIB).status == OK
    some = checks.memory("cuda:0", plan, 4 * GIB)
    assert some.status == WARN and "only stage 0 fit" in some.detail
    none = checks.memory("cuda:0", plan, 1 * GIB)
    assert none.status == FAIL and "2.00, 6.00 GiB per stage" in none.detail and "no stage fits" in none.detail
    assert checks.memory("", None, 0, "no --tracker").status == SKIP


def test_exit_code_is_1_only_when_a_check_failed() -> None:
    assert checks.exit_code([checks.Check("a", OK, ""), checks.Check("b", WARN, ""), checks.Check("c", SKIP, "")]) == 0
    assert checks.exit_code([checks.Check("a", OK, ""), checks.Check("b", FAIL, "")]) == 1


@pytest.mark.processes
def test_parsing_the_flags_imports_neither_torch_nor_hivemind() -> None:
    code = (
        "import sys; from peer.doctor.run import add_doctor_parser; import argparse; "
        "p = argparse.ArgumentParser(); add_doctor_parser(p.add_subparsers(dest='c')); p.parse_args(['doctor']); "
        "print(sorted(m for m in ('torch', 'hivemind', 'grpc') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.processes
def test_usage_errors_exit_2() -> None:
    res = doctor("--grpc-port", "70000")
    assert res.returncode == 2 and "--grpc-port=70000: must be a port number" in res.stderr
    assert doctor("--no-such-flag").returncode == 2


@pytest.mark.processes
def test_the_real_command_prints_one_line_per_check(tmp_path: Path) -> None:
    res = doctor("--state-dir", str(tmp_path))
    lines = res.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["gpu", "torch", "shm", "grpc", "dht", "disk", "clock", "memory"]
    assert all(line.split()[0] in (OK, WARN, FAIL, SKIP) for line in lines)
    assert res.returncode == (1 if any(line.startswith(FAIL) for line in lines) else 0), res.stdout


@pytest.mark.processes
def test_against_a_tracker_it_checks_the_version_and_the_runs_memory_plan(tmp_path: Path) -> None:
    from bootstrap import keys
    from bootstrap.node import default_run
    from bootstrap.server import serve_tracker
    from bootstrap.tracker import Tracker

    secrets = keys.load_or_create(tmp_path / "boot", TOKEN)
    server, address = serve_tracker(Tracker("run-doctor", default_run()), "127.0.0.1", 0, secrets)
    try:
        res = doctor("--tracker", address, "--token", TOKEN, "--device", "cpu")
        lines = {line.split()[1]: line for line in res.stdout.splitlines()}
        assert lines["tracker"].startswith(f"ok    tracker   {address} serves run-doctor"), res.stdout + res.stderr
        assert lines["memory"].startswith("ok    memory") and "GiB per stage" in lines["memory"], res.stdout
        assert lines["clock"].startswith("ok    clock") and "the tracker" in lines["clock"], res.stdout  # one machine
        wrong = doctor("--tracker", address, "--token", "not-the-token-of-this-run")
        assert wrong.returncode == 1 and "fail  tracker" in wrong.stdout and "wrong run token" in wrong.stdout
    finally:
        server.stop(grace=0).wait()
