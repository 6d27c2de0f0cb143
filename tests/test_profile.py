"""`anchormesh bench profile`'s py-spy breakdown: on-CPU samples are charged to the innermost part
they run in; samples waiting in a lock, sleep or poll count as idle."""

from __future__ import annotations

from pathlib import Path

from peer.bench.profile import breakdown


def test_samples_go_to_the_innermost_part_and_waits_are_idle(tmp_path: Path) -> None:
    raw = tmp_path / "spy0.txt"
    raw.write_text(
        "\n".join(
            [
                "main (peer/cli.py:1);_tick (peer/daemon/main.py:5);forward_one (peer/pipeline/worker.py:9);forward (peer/model/stages.py:3);linear (torch/nn/modules/linear.py:7) 60",
                "main (peer/cli.py:1);_tick (peer/daemon/main.py:5);forward_one (peer/pipeline/worker.py:9);encode (peer/codec/mask.py:40) 20",
                "main (peer/cli.py:1);_tick (peer/daemon/main.py:5);wait (peer/pipeline/grpc_transport.py:30);Condition.wait (threading.py:331) 50",
                "_sender (peer/pipeline/grpc_transport.py:90);__call__ (grpc/_channel.py:100);SerializeToString (x.py:1) 10",
                "_tick (peer/daemon/main.py:5);apply_step (peer/pipeline/worker.py:400) 10",
            ]
        )
    )
    out = breakdown([raw])
    assert out["on_cpu_samples"] == 100 and out["idle_samples"] == 50
    assert out["shares"] == {
        "model forward/backward": 0.6,
        "codec": 0.2,
        "wire serialization / validation": 0.1,
        "stage loop (runner, daemon)": 0.1,
    }


def test_a_check_is_charged_what_it_calls_and_a_wrapper_is_not(tmp_path: Path) -> None:
    """The innermost anchormesh frame owns a sample: a DHT signature's cryptography and a Merkle
    commitment's hashing are the checks'; a size-limit wrapper's parsing and the handler it wraps
    are not; a wait is not counted at all."""
    from peer.bench.profile_checks import checks_breakdown

    raw = tmp_path / "spy0.txt"
    raw.write_text(
        "\n".join(
            [
                "run (hivemind/p2p/servicer.py:1);validate_request (/x/peer/security/dht_auth.py:150);verify (cryptography/ed25519.py:9) 10",
                "_commit (/x/peer/dp/hivemind_averager.py:172);commit_claim (/x/peer/dp/audit.py:55);commit (/x/peer/dp/commitment.py:68) 5",
                "deserialize (/x/peer/security/limits.py:60) 20",
                "call (/x/peer/security/limits.py:73);Forward (/x/peer/pipeline/stage_server.py:9);linear (torch/nn/modules/linear.py:7) 45",
                "on_message (/x/peer/pipeline/inbound.py:60);check (/x/peer/pipeline/bounds.py:77) 20",
                "wait (/x/peer/pipeline/bounds.py:77);Condition.wait (threading.py:331) 30",
            ]
        )
    )
    out = checks_breakdown([raw])
    assert out["on_cpu_samples"] == 100 and out["check_samples"] == 35
    assert out["per_check"] == {"link bounds": 0.2, "DHT request signatures": 0.1, "round commitments and audits": 0.05}


def test_checks_weigh_by_the_process_kinds_share_and_tls_runs_compare_by_median() -> None:
    from peer.bench.profile_checks import compare, share_of_machine

    kinds = {"peer": {"share_of_process_cpu": 0.1}, "hivemind kids": {"share_of_process_cpu": 0.5}}
    assert share_of_machine(kinds, {"peer": 0.7, "hivemind kids": 0.06}) == round(0.07 + 0.03, 4)

    def run(tls: bool, tps: float, hm: float) -> dict:
        return {"tls": tls, "tokens_per_s": tps, "cpu_share_of_machine": {"hivemind p2pd (Go)": hm, "peer": 0.5}}

    out = compare(
        [run(True, 900, 0.1), run(False, 1000, 0.08), run(True, 1200, 0.3), run(False, 800, 0.04), run(True, 950, 0.12)]
    )
    assert out["tokens_per_s"] == {"tls": 950, "plaintext": 900, "tls_over_plaintext": round(950 / 900, 3)}
    assert out["hivemind_share"]["tls"] == 0.12 and out["hivemind_share"]["plaintext"] == 0.06
    assert out["runs_each"] == {"tls": 3, "plaintext": 2}
