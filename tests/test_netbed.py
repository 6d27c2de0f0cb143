"""The shaped-network test bed: 3 network namespaces on a bridge, each link shaped with tbf;
a real swarm (bootstrap + 2 peers, one per stage) trains across them, and everything the bed
made is gone afterwards. Functional, not timed."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from peer.bench import netbed
from peer.bench.bedswarm import BedSwarm

REASON = netbed.available()
pytestmark = [pytest.mark.processes, pytest.mark.skipif(bool(REASON), reason=f"no network namespaces here: {REASON}")]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_swarm_trains_across_shaped_namespaces(tmp_path: Path) -> None:
    bed = netbed.NetBed([50.0, 20.0, 20.0], subnet=7)
    with bed:
        qdisc = subprocess.run(
            ["ip", "netns", "exec", bed.hosts[1].ns, "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdisc and "20Mbit" in qdisc, qdisc
        before = bed.counters()
        swarm = BedSwarm(bed, None, tmp_path)
        assert swarm.info["tracker"].startswith("198.18.7.1:")
        s = swarm.wait_status(
            lambda s: (
                s["step"] >= 3
                and s["loss"] is not None
                and len([p for p in s["peers"] if p["state"] in ("active", "idle")]) == 2
            ),
            240,
            "2 live peers and 3 steps",
        )
        assert math.isfinite(s["loss"])
        assert {p["address"].split(":")[0] for p in s["peers"]} == {"198.18.7.2", "198.18.7.3"}
        # off loopback by default: TLS with the CA the tracker vouches for, a private status, the key required
        info = swarm.info
        assert "BEGIN CERTIFICATE" in info["tls_ca"] and info["address"] == f"{info['tracker']}#{info['tracker_key']}"
        in_bed = ["ip", "netns", "exec", bed.hosts[0].ns, sys.executable, "-m", "peer.cli"]
        res = subprocess.run(
            [*in_bed, "status", "--tracker", info["address"], "--json"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 1 and "UNAUTHENTICATED" in res.stderr, (
            res.stderr
        )  # TLS came up with the fetched CA; the token is missing
        res = subprocess.run(
            [*in_bed, "status", "--tracker", info["tracker"], "--json"], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 1 and "--tls-ca" in res.stderr, res.stderr  # plaintext reaches nothing
        res = subprocess.run(
            [*in_bed, "peer", "--tracker", info["tracker"], "--token", info["token"], "--host", "198.18.7.1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 2 and "HOST:PORT#KEY" in res.stderr, res.stderr
        after = bed.counters()
        # activations went from host 1 (stage 0) to host 2 (stage 1) and gradients back, over the shaped links
        sent = {i: after[i][0] - before[i][0] for i in after}
        assert sent[1] > 50_000 and sent[2] > 50_000, sent
        pids = [p.pid for p in bed.procs]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), (
            f"process {pid} left running"
        )
    assert bed.tag not in _namespaces()


def test_rate_and_cleanup_on_error() -> None:
    bed = netbed.NetBed([None, 8.0], subnet=8)
    with pytest.raises(RuntimeError, match="boom"):
        with bed:
            bed.set_rate(0, 4.0)
            out = subprocess.run(
                ["ip", "netns", "exec", bed.hosts[0].ns, "tc", "qdisc", "show", "dev", "eth0"],
                capture_output=True,
                text=True,
            ).stdout
            assert "tbf" in out and "4Mbit" in out, out
            bed.set_rate(0, None)
            out = subprocess.run(
                ["ip", "netns", "exec", bed.hosts[0].ns, "tc", "qdisc", "show", "dev", "eth0"],
                capture_output=True,
                text=True,
            ).stdout
            assert "tbf" not in out, out
            raise RuntimeError("boom")
    assert bed.tag not in _namespaces()


def test_a_slow_link_is_measured_and_sends_fewer_coefficients(tmp_path: Path) -> None:
    """Both peers on 0.5 Mbit/s links: the stage-0 peer measures its link from its stream's acks
    (status `link_mbit`) and sends a share of the low-rank codec's rank that fits it (`pp_keep`
    < 1), and the swarm trains on."""
    from peer.bench.bedswarm import write_toml

    cfg = tmp_path / "run.toml"
    write_toml(
        {
            "mask": {"scheme": "lowrank", "rank": 64, "values": "int8", "min_keep": 0.125},
            "pipeline": {"micro_batch_size": 8, "micro_batches": 2, "seq_len": 128},
        },
        cfg,
    )
    with netbed.NetBed([None, 0.5, 0.5], subnet=9) as bed:
        swarm = BedSwarm(bed, cfg, tmp_path / "swarm")

        def adapted(s: dict) -> bool:
            first = [p for p in s["peers"] if p["stage"] == 0 and p["state"] in ("active", "idle")]
            return s["step"] >= 3 and bool(first) and (first[0]["pp_keep"] or 1.0) < 1.0

        s = swarm.wait_status(adapted, 240, "the stage-0 peer to send fewer coefficients")
        first = next(p for p in s["peers"] if p["stage"] == 0 and p["state"] in ("active", "idle"))
        print(f"stage 0 on a 0.5 Mbit/s link: link_mbit {first['link_mbit']:.3f}, pp_keep {first['pp_keep']:.3f}")
        assert 0.05 < first["link_mbit"] < 1.0, (
            first
        )  # the measured link is the shaped one (tbf's burst lets a little more through)
        assert 0.125 <= first["pp_keep"] < 1.0, first
        assert math.isfinite(s["loss"])
    assert bed.tag not in _namespaces()
