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
