"""docker/ without a Docker engine: every command the images and the compose file run is parsed by
the real CLI parser (a renamed or missing flag fails here), the images run as a non-root user,
ports and tracker addresses agree, and `anchormesh health` is run for real against live servers."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import tomllib
from argparse import Namespace
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path

import pytest
import yaml

from peer.cli import _parser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# -- helpers --------------------------------------------------------------------------------------
def parse_cli(argv: list[str], where: str) -> Namespace:
    """The real `anchormesh` parser on `argv`; a flag it does not know fails the test, naming `where`."""
    err = StringIO()
    try:
        with redirect_stderr(err):
            return _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `anchormesh {' '.join(argv)}` is refused by peer.cli: {err.getvalue().strip()}")


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs of docker/NAME, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (DOCKER / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        instruction, _, rest = (pending + line).partition(" ")
        out.append((instruction.upper(), rest.strip()))
        pending = ""
    assert not pending, f"{name}: a continuation line runs off the end"
    return out


def one(instructions: list[tuple[str, str]], key: str) -> str:
    """The last KEY instruction (Docker uses the last ENTRYPOINT / CMD / HEALTHCHECK / USER)."""
    found = [rest for k, rest in instructions if k == key]
    assert found, f"no {key}"
    return found[-1]


def exec_form(text: str) -> list[str]:
    """An exec-form (JSON array) argument list; shell form would hide the args from this test."""
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(x, str) for x in value), text
    return value


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def compose(name: str = "compose.yaml") -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


def merged(base: dict, override: dict) -> dict:
    """`docker compose -f base -f override`, as far as these files use it: mappings merge key by key,
    anything else (a command, a list) is replaced by the override's."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def peers(spec: dict) -> dict[str, dict]:
    return {name: svc for name, svc in spec["services"].items() if svc["command"][0] == "peer"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "peer.cli", "health", *args], capture_output=True, text=True, timeout=60, env=ENV
    )


# -- the Dockerfiles ------------------------------------------------------------------------------
IMAGES = {
    # name: (CMD subcommand, the flag holding its main port, ports it must EXPOSE, health extra flags)
    "peer.Dockerfile": ("peer", "grpc_port", ["grpc_port"], []),
    "bootstrap.Dockerfile": ("bootstrap", "port", ["port", "dht_port"], ["--tracker"]),
}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dockerfile_cmd_and_healthcheck_parse_with_the_real_cli(name: str) -> None:
    sub, port_flag, exposed_flags, health_extra = IMAGES[name]
    d = dockerfile(name)
    assert exec_form(one(d, "ENTRYPOINT")) == ["anchormesh"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["anchormesh"] == "peer.cli:main"  # the ENTRYPOINT is the console script

    cmd = parse_cli(exec_form(one(d, "CMD")), f"{name} CMD")
    assert cmd.command == sub
    assert cmd.host == "0.0.0.0" and str(cmd.state_dir) == "/state"

    hc_text = one(d, "HEALTHCHECK")
    assert " CMD [" in hc_text, "HEALTHCHECK must use the exec form"
    hc_argv = exec_form(hc_text.split(" CMD ", 1)[1])
    assert hc_argv[0] == "anchormesh"
    hc = parse_cli(hc_argv[1:], f"{name} HEALTHCHECK")
    assert hc.command == "health" and hc.tracker == ("--tracker" in health_extra)
    assert hc.address == f"127.0.0.1:{getattr(cmd, port_flag)}", "the health check must call the port the CMD serves on"

    exposed = {int(p.split("/")[0]) for k, rest in d if k == "EXPOSE" for p in rest.split()}
    assert {getattr(cmd, f) for f in exposed_flags} <= exposed


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_images_run_as_a_non_root_user_with_state_on_a_volume(name: str) -> None:
    d = dockerfile(name)
    user = one(d, "USER").split(":")[0]
    assert user not in ("root", "0"), user
    assert any(k == "RUN" and "useradd --uid 10001" in rest for k, rest in d)
    assert user in ("10001", "anchormesh")
    # USER comes after every install step, so nothing at run time runs as root
    last_user = max(i for i, (k, _) in enumerate(d) if k == "USER")
    assert all(k != "RUN" for k, _ in d[last_user:])
    assert one(d, "WORKDIR") == "/home/anchormesh"
    assert one(d, "VOLUME") in ("/state", '["/state"]')
    assert any(k == "RUN" and "chown anchormesh:anchormesh /state" in rest for k, rest in d)


# The CUDA version of torch 2.13.0's default Linux x86_64 wheel on PyPI (what `pip install
# torch==2.13.0` gets in the CUDA image): its torch/version.py says `__version__ = '2.13.0+cu130'`,
# `cuda = '13.0'`, and its METADATA has `Requires-Dist: cuda-toolkit[cublas,cudart,...]==13.0.3` and
# `nvidia-cudnn-cu13`, `nvidia-nccl-cu13`, ... (read from torch-2.13.0-cp312-cp312-
# manylinux_2_28_x86_64.whl fetched with `pip download torch==2.13.0 --no-deps --index-url
# https://pypi.org/simple`; the cp311 wheel, which the Ubuntu image's Python 3.11 installs, requires the same).
# Those pip packages carry the CUDA libraries, so the base image only has to match the version (and
# the host driver must be >= 580.65.06, the CUDA 13.0 minimum). Change both together with TORCH_VERSION.
TORCH_VERSION = "2.13.0"
TORCH_CUDA = "13.0"
CUDA_BASE = re.compile(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(base|runtime)-ubuntu22\.04")


def test_the_cuda_base_matches_the_cuda_of_the_pinned_torch_wheel() -> None:
    d = dockerfile("peer.Dockerfile")
    assert ("ARG", f"TORCH_VERSION={TORCH_VERSION}") in d
    base = next(rest for k, rest in d if k == "ARG" and rest.startswith("BASE="))
    m = CUDA_BASE.fullmatch(base.removeprefix("BASE="))
    assert m, f"{base}: expected nvidia/cuda:X.Y.Z-base|runtime-ubuntu22.04"
    assert f"{m[1]}.{m[2]}" == TORCH_CUDA, f"{base}: torch {TORCH_VERSION}'s wheels are built for CUDA {TORCH_CUDA}"
    # the documents name this base and the driver it needs (CUDA 13.0: >= 580.65.06)
    for doc in (
        DOCKER / "peer.Dockerfile",
        DOCKER / "compose.gpu.yaml",
        ROOT / "docs/volunteer.md",
        ROOT / "README.md",
    ):
        text = doc.read_text()
        assert base.removeprefix("BASE=") in text, f"{doc.name}: does not name the peer image's base"
        assert "580.65.06" in text, f"{doc.name}: states no minimum driver for CUDA {TORCH_CUDA}"


def test_bases_cuda_for_the_peer_cpu_for_the_bootstrap_both_switchable() -> None:
    peer, boot = dockerfile("peer.Dockerfile"), dockerfile("bootstrap.Dockerfile")
    assert any(k == "ARG" and CUDA_BASE.fullmatch(rest.removeprefix("BASE=")) for k, rest in peer)
    assert ("ARG", "BASE=python:3.12-slim") in boot
    for d in (peer, boot):
        assert ("FROM", "${BASE}") in d
        torch = [rest for k, rest in d if k == "RUN" and "torch==" in rest]
        assert torch and "--index-url" in torch[0]  # TORCH_INDEX selects the CPU wheels
    assert ("ARG", "TORCH_INDEX=https://download.pytorch.org/whl/cpu") in boot
    assert ("ARG", "TORCH_INDEX=") in peer  # CUDA image: torch from the default index


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_build_context_ignore_file_keeps_what_the_copies_need(name: str) -> None:
    kept = {
        line[1:].rstrip("/")
        for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for k, rest in dockerfile(name):
        if k == "COPY":
            for src in rest.split()[:-1]:
                assert src in kept and (ROOT / src).exists(), src


def test_a_renamed_flag_fails_the_parse() -> None:
    """The check above is not vacuous: a flag the CLI does not have fails."""
    with pytest.raises(pytest.fail.Exception, match="--grpc-prot"):
        parse_cli(["peer", "--grpc-prot", "7100"], "example")


# -- compose.yaml ---------------------------------------------------------------------------------
def test_compose_commands_and_healthchecks_parse_with_the_real_cli() -> None:
    spec = compose()
    for name, svc in spec["services"].items():
        args = parse_cli(svc["command"], f"compose {name}.command")
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "anchormesh", test
        hc = parse_cli(test[2:], f"compose {name}.healthcheck")
        assert hc.command == "health"
        if args.command == "bootstrap":
            assert hc.tracker and port_of(hc.address) == args.port
        else:
            assert not hc.tracker and port_of(hc.address) == args.grpc_port


def test_compose_is_a_bootstrap_and_three_peers_from_the_two_dockerfiles() -> None:
    spec = compose()
    boots = [n for n, s in spec["services"].items() if s["command"][0] == "bootstrap"]
    assert boots == ["bootstrap"] and len(peers(spec)) == 3
    assert spec["services"]["bootstrap"]["build"]["dockerfile"] == "docker/bootstrap.Dockerfile"
    for name, svc in peers(spec).items():
        build = svc["build"]
        assert (
            build["dockerfile"] == "docker/peer.Dockerfile"
            and (DOCKER / build["context"] / build["dockerfile"]).is_file()
        )
        assert build["args"]["BASE"] == "python:3.12-slim"  # the CPU build
        assert build["args"]["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"


def test_compose_ports_match_the_bootstrap_flags() -> None:
    boot = compose()["services"]["bootstrap"]
    args = parse_cli(boot["command"], "compose bootstrap.command")
    assert args.host == "0.0.0.0"  # published ports reach it
    # peers dial the tracker address and DHT multiaddrs it publishes: its service name, not 0.0.0.0
    assert args.announce_host == "bootstrap" and args.dht_port
    container_ports = {int(p.split(":")[-1]) for p in boot["ports"]}
    assert container_ports == {args.port, args.dht_port}
    assert any(v.endswith(":/state") for v in boot["volumes"]) and str(args.state_dir) == "/state"


def test_every_peer_names_the_bootstrap_tracker_and_serves_on_its_own_port() -> None:
    spec = compose()
    boot = parse_cli(spec["services"]["bootstrap"]["command"], "compose bootstrap.command")
    grpc_ports = []
    for name, svc in peers(spec).items():
        args = parse_cli(svc["command"], f"compose {name}.command")
        assert args.tracker, f"{name}: no --tracker"
        host, port = args.tracker.rsplit(":", 1)
        assert int(port) == boot.port, f"{name}: --tracker {args.tracker} is not the bootstrap's --port {boot.port}"
        # each peer has its own network stack: it reaches the bootstrap by its service name, binds all
        # interfaces and tells the tracker its own service name, which is what other peers dial
        assert host == "bootstrap", (name, args.tracker)
        assert "network_mode" not in svc, f"{name}: shares another container's network namespace"
        assert args.host == "0.0.0.0" and args.announce_host == name, (name, args.host, args.announce_host)
        assert svc["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        grpc_ports.append(args.grpc_port)
        assert any(v.endswith(":/state") for v in svc["volumes"]) and str(args.state_dir) == "/state"
    peer_image = parse_cli(exec_form(one(dockerfile("peer.Dockerfile"), "CMD")), "peer.Dockerfile CMD")
    assert set(grpc_ports) == {peer_image.grpc_port}, "the port the peer image EXPOSEs and health-checks"
    # each service writes its own volume; peers read the bootstrap's, read-only, for the tracker key
    volumes = [v.split(":")[0] for s in spec["services"].values() for v in s["volumes"] if not v.endswith(":ro")]
    assert len(set(volumes)) == len(volumes) and set(volumes) <= set(spec["volumes"])
    assert all("bootstrap-state:/boot:ro" in svc["volumes"] for svc in peers(spec).values())
    assert all(svc["environment"]["ANCHORMESH_TRACKER_KEY"] == "@/boot/bootstrap.json" for svc in peers(spec).values())


def test_compose_peers_get_shared_memory_for_the_averager() -> None:
    """hivemind's averager process shares the stage state through /dev/shm (Docker's default: 64 MB)."""
    for name, svc in peers(compose()).items():
        assert svc.get("ipc") == "host" or svc.get("shm_size"), f"{name}: neither shm_size nor ipc: host"


def test_the_gpu_compose_override_builds_the_cuda_image_and_reserves_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from peer.model.placement import parse_device

    base, gpu = compose(), compose("compose.gpu.yaml")
    assert set(gpu["services"]) <= set(peers(base)), "the override adds no service of its own"
    assert set(gpu["services"]) == set(peers(base)), "every peer gets the GPU"
    cuda_base = next(
        rest for k, rest in dockerfile("peer.Dockerfile") if k == "ARG" and rest.startswith("BASE=")
    ).removeprefix("BASE=")
    spec = merged(base, gpu)
    for name, svc in peers(spec).items():
        assert svc["build"]["dockerfile"] == "docker/peer.Dockerfile"
        assert (
            svc["build"]["args"]["BASE"] == cuda_base and svc["build"]["args"]["TORCH_INDEX"] == ""
        )  # torch's CUDA wheel
        assert svc["image"] != base["services"][name]["image"], (
            f"{name}: the CUDA build would overwrite the CPU image's tag"
        )
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(
            d["driver"] == "nvidia" and "gpu" in d["capabilities"] and ("count" in d or "device_ids" in d)
            for d in devices
        ), devices
        assert svc.get("ipc") == "host" or svc.get("shm_size"), f"{name}: neither shm_size nor ipc: host"
        # the merged command and environment, through the real parser: env vars are flag defaults
        env = {k: str(v) for k, v in svc["environment"].items()}
        for k, v in env.items():
            if k != "ANCHORMESH_TOKEN":
                monkeypatch.setenv(k, v)
        args = parse_cli(svc["command"], f"compose.gpu.yaml {name}.command")
        assert args.command == "peer" and args.announce_host == name and args.tracker == "bootstrap:7000"
        if "ANCHORMESH_DEVICE" in env:
            assert args.device == env["ANCHORMESH_DEVICE"]
        # the device it asks for is one the peer accepts on a machine with a GPU
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert parse_device(args.device).type == "cuda", args.device
        monkeypatch.undo()
        test = svc["healthcheck"]["test"]
        assert port_of(parse_cli(test[2:], f"compose.gpu.yaml {name}.healthcheck").address) == args.grpc_port


# -- documented `docker run` lines ----------------------------------------------------------------
DOCS = ("README.md", "docs/volunteer.md", "docs/troubleshooting.md")
# docker run options these documents use: those that take no value, the rest take one
RUN_SWITCHES = {"-d", "--detach", "--rm", "-i", "-t", "-it", "--init"}
RUN_OPTIONS = {
    "--gpus",
    "--ipc",
    "--shm-size",
    "--network",
    "--name",
    "-v",
    "--volume",
    "-e",
    "--env",
    "-p",
    "--publish",
    "--entrypoint",
    "-u",
    "--user",
    "--runtime",
}


def docker_runs(doc: str) -> list[tuple[dict[str, list[str]], str, list[str]]]:
    """(options, image, arguments) of each `docker run` in the shell blocks of DOC, continuation
    lines joined and comments dropped."""
    text = (ROOT / doc).read_text()
    out = []
    for lang, block in re.findall(r"```(\w*)\n(.*?)```", text, re.S):  # every fenced block, so fences pair up
        if lang not in ("", "bash", "sh", "console"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(
                re.sub(r"(^|\s)#.*$", "", line)
            )  # as bash: a '#' starts a comment only at a word's start (HOST:PORT#KEY is one word)
            if argv[:2] != ["docker", "run"]:
                continue
            opts: dict[str, list[str]] = {}
            i = 2
            while argv[i].startswith("-"):
                flag, eq, value = argv[i].partition("=")
                if flag in RUN_SWITCHES:
                    opts.setdefault(flag, []).append("")
                else:
                    assert flag in RUN_OPTIONS, (
                        f"{doc}: `{line.strip()}`: docker run option {flag} unknown to this test"
                    )
                    if not eq:
                        i += 1
                        value = argv[i]
                    opts.setdefault(flag, []).append(value)
                i += 1
            out.append((opts, argv[i], argv[i + 1 :]))
    return out


def test_documented_peer_containers_get_the_gpu_and_shared_memory() -> None:
    """Every documented `docker run` of the peer image gives the averager shared memory (--ipc=host
    or --shm-size), the CUDA image's also `--gpus`, and its command passes the real parser."""
    seen = 0
    for doc in DOCS:
        for opts, image, args in docker_runs(doc):
            name, _, tag = image.partition(":")
            if name != "anchormesh-peer" or "--entrypoint" in opts:  # another image, or a one-off check
                continue
            seen += 1
            where = f"{doc}: docker run ... {image} {' '.join(args)}"
            assert opts.get("--ipc") == ["host"] or "--shm-size" in opts, f"{where}: neither --ipc=host nor --shm-size"
            if tag != "cpu":
                assert "--gpus" in opts, f"{where}: the CUDA image without --gpus trains on the CPU"
            if args:  # the peer, or its pre-flight check on the same machine
                assert parse_cli(args, where).command in ("peer", "doctor")
    assert seen >= 4, "README and docs/volunteer.md show the peer's docker run lines"


def test_the_documented_gpu_check_runs_the_images_venv_python() -> None:
    """`torch.cuda.is_available()` inside the container: the check uses the image's own Python."""
    venv = next(rest.split()[-1] for k, rest in dockerfile("peer.Dockerfile") if k == "RUN" and "-m venv" in rest)
    checks = [
        (doc, opts, image, args) for doc in DOCS for opts, image, args in docker_runs(doc) if "--entrypoint" in opts
    ]
    assert checks, "no documented in-container GPU check"
    for doc, opts, image, args in checks:
        assert opts["--entrypoint"] == [f"{venv}/bin/python"], (doc, opts)
        assert image == "anchormesh-peer" and "--gpus" in opts and "torch.cuda.is_available()" in " ".join(args), (
            doc,
            image,
            args,
        )


def test_announce_maddr_is_an_address_or_a_dns_name() -> None:
    from peer.address import announce_maddr

    assert announce_maddr("bootstrap", 7001) == "/dns4/bootstrap/tcp/7001"
    assert announce_maddr("10.1.2.3", 7001) == "/ip4/10.1.2.3/tcp/7001"
    assert announce_maddr("::1", 7001) == "/ip6/::1/tcp/7001"


@pytest.mark.processes
def test_a_bootstrap_announcing_a_name_is_joined_through_that_name(tmp_path: Path) -> None:
    """What the compose file relies on, on loopback: `--announce-host NAME` puts NAME in the tracker
    address and the DHT multiaddrs (/dns4/NAME), and a peer given only that tracker address starts
    its DHT node from them (libp2p resolves the name) and joins."""
    from peer.demo.swarm import start_process, stop_processes, wait_for_bootstrap

    procs = []
    try:
        procs.append(
            start_process(
                [
                    "bootstrap",
                    "--host",
                    "127.0.0.1",
                    "--announce-host",
                    "localhost",
                    "--state-dir",
                    str(tmp_path / "boot"),
                ],
                tmp_path / "boot.log",
            )
        )
        info = wait_for_bootstrap(tmp_path / "boot", procs[0], tmp_path / "boot.log", timeout_s=60)
        assert info["tracker"].startswith("localhost:"), info
        assert info["dht_maddrs"] and all(m.startswith("/dns4/localhost/tcp/") for m in info["dht_maddrs"]), info
        log = tmp_path / "peer.log"
        procs.append(
            start_process(
                [
                    "peer",
                    "--tracker",
                    info["tracker"],
                    "--token",
                    info["token"],
                    "--host",
                    "127.0.0.1",
                    "--announce-host",
                    "localhost",
                ],
                log,
            )
        )
        deadline = time.monotonic() + 90
        while " joined " not in log.read_text():
            assert time.monotonic() < deadline and procs[1].poll() is None, log.read_text()[-3000:]
            time.sleep(0.3)
        text = log.read_text()
        assert "/dns4/localhost/tcp/" in text and "DHT node up" in text and "serving on localhost:" in text
    finally:
        stop_processes(procs, grace_s=10)


# -- `anchormesh health`, for real ----------------------------------------------------------------
@pytest.fixture
def tracker_address():
    from bootstrap.node import default_run
    from bootstrap.server import serve_tracker
    from bootstrap.tracker import Tracker

    server, address = serve_tracker(Tracker("run-health", default_run()), "127.0.0.1", 0)
    yield address
    server.stop(grace=0).wait()


@pytest.mark.processes
def test_health_of_a_live_tracker_exits_0(tracker_address: str) -> None:
    out = health("--address", tracker_address, "--tracker")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"ok tracker {tracker_address}: run run-health") and out.stdout.count("\n") == 1


@pytest.mark.processes
def test_health_of_a_closed_port_exits_1_with_one_line_naming_address_and_status() -> None:
    address = f"127.0.0.1:{free_port()}"
    for extra in (["--tracker"], []):
        out = health("--address", address, "--timeout", "3", *extra)
        assert out.returncode == 1 and out.stdout == ""
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and address in lines[0] and "UNAVAILABLE" in lines[0], out.stderr


@pytest.mark.processes
def test_a_tracker_is_not_a_stage_server(tracker_address: str) -> None:
    out = health("--address", tracker_address)
    assert out.returncode == 1 and "UNIMPLEMENTED" in out.stderr and tracker_address in out.stderr


@pytest.mark.processes
def test_health_pings_a_stage_server() -> None:
    from peer.pipeline.grpc_transport import GrpcTransport

    # the health check's empty run id is a liveness probe: a peer that has joined run-a answers it in
    # full, as does a server whose run id is still empty (as a daemon's before it joins)
    joined = GrpcTransport("run-a")
    blank = GrpcTransport("")
    # a peer of an older version refused an empty run id: a live answer all the same
    old = GrpcTransport("run-a")
    old._ping_handler = lambda addr: (
        lambda data, context: old._reject(context, addr, "PingRequest.run_id='': this server trains run 'run-a'")
    )
    try:
        a, b, c = joined.attach((0, 0)), blank.attach((1, 0)), old.attach((0, 1))
        out = health("--address", a)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"ok stage server {a}: peer stage0.r0, stage 0, step 0"
        out = health("--address", b)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"ok stage server {b}: peer stage1.r0, stage 1, step 0"
        out = health("--address", c)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"ok stage server {c}: serving (this server trains run 'run-a')"
        assert not joined.rejected and not blank.rejected
    finally:
        joined.close()
        blank.close()
        old.close()


@pytest.mark.processes
def test_health_timeout_must_be_positive() -> None:
    out = health("--address", "127.0.0.1:1", "--timeout", "0")
    assert out.returncode == 2 and "--timeout=0.0: must be > 0" in out.stderr
