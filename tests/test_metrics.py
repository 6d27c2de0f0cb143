"""GET /metrics serves the status in Prometheus text format; missing figures are left out."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer.metrics import CONTENT_TYPE, exposition, serve_metrics

SAMPLE = json.loads((Path(__file__).parent / "data" / "status_sample.json").read_text())


@pytest.fixture
def served() -> Iterator[tuple[str, list[dict]]]:
    """A server on a free loopback port whose collect returns (a copy of) statuses[-1]."""
    statuses = [copy.deepcopy(SAMPLE)]

    def collect() -> dict:
        if statuses[-1] is None:
            raise RuntimeError("tracker gone")
        return statuses[-1]

    server = serve_metrics(0, collect, host="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", statuses
    finally:
        server.shutdown()
        server.server_close()


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_metrics_endpoint_serves_the_status(served: tuple[str, list[dict]]) -> None:
    url, _ = served
    code, ctype, body = _get(url + "/metrics")
    assert code == 200 and ctype == CONTENT_TYPE
    lines = body.splitlines()
    for sample in (
        "anchormesh_step 480",
        "anchormesh_tokens_total 1966080",
        "anchormesh_loss 2.7341",
        "anchormesh_eval_loss 2.8107",
        "anchormesh_tokens_per_second 3412.5",
        "anchormesh_pp_bytes_per_token 43.5",
        "anchormesh_dp_bytes_per_token 12.4",
        'anchormesh_stage_peers{stage="0"} 2',
        'anchormesh_stage_peers{stage="1"} 1',
        'anchormesh_peer_tokens_per_second{peer="peer-alpha",stage="0"} 1790.0',
        'anchormesh_peer_tokens_per_second{peer="peer-charlie",stage="1"} 1720.0',
    ):
        assert sample in lines, (sample, body)
    assert "# TYPE anchormesh_step gauge" in lines and "# TYPE anchormesh_tokens_total counter" in lines
    assert "peer-delta" not in body and "peer-echo~1" not in body  # dead and departed peers: no series


def test_missing_values_are_left_out_and_each_scrape_is_fresh(served: tuple[str, list[dict]]) -> None:
    url, statuses = served
    s = copy.deepcopy(SAMPLE)
    s.update(step=481, loss=None, eval_loss=float("nan"))
    statuses.append(s)
    _, _, body = _get(url + "/metrics")
    assert "anchormesh_step 481" in body.splitlines()
    assert "anchormesh_loss" not in body and "anchormesh_eval_loss" not in body and "NaN" not in body


def test_other_paths_404_and_a_failing_collect_503(served: tuple[str, list[dict]]) -> None:
    url, statuses = served
    assert _get(url + "/")[0] == 404
    statuses.append(None)  # type: ignore[arg-type]
    code, _, body = _get(url + "/metrics")
    assert code == 503 and "tracker gone" in body


def test_label_values_are_escaped() -> None:
    s = {"stages": [], "peers": [{"id": 'odd"id\\x', "stage": 0, "state": "active", "tokens_per_s": 1.5}]}
    assert 'anchormesh_peer_tokens_per_second{peer="odd\\"id\\\\x",stage="0"} 1.5' in exposition(s).splitlines()


def test_a_peer_serves_its_own_figures(tmp_path: Path) -> None:
    """A real PeerDaemon's figures (`--metrics-port`): labelled with its id and stage; the loss
    only on the last stage and only once there is one; the checkpoint step once one is written."""
    import math

    from peer.config import MaskConfig, ModelConfig, PipelineConfig, TrainConfig
    from peer.daemon.main import PeerDaemon
    from peer.metrics import peer_exposition
    from peer.model.loading import load_causal_lm
    from peer.model.stages import split_model
    from peer.pipeline.worker import StageWorker

    cfg = TrainConfig(
        model=ModelConfig(name="tiny-llama", num_stages=2, hidden_size=32, num_layers=2, num_heads=2, max_seq_len=16),
        mask=MaskConfig(scheme="mask"),
        pipeline=PipelineConfig(micro_batch_size=2, seq_len=8, max_staleness=0),
    )
    d = PeerDaemon("127.0.0.1:9", state_dir=tmp_path)
    server = serve_metrics(0, d.metrics, host="127.0.0.1", render=peer_exposition)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        code, ctype, body = _get(url)  # before it has a stage: no crash, its state
        assert (
            code == 200
            and ctype == CONTENT_TYPE
            and f'anchormesh_peer_state{{peer="{d.peer_id}",stage="",state="joining"}} 1' in body
        )
        stage = split_model(load_causal_lm(cfg.model, seed=0), 2)[1]
        d.worker = StageWorker(stage, 0, cfg, d.transport, "run", peer_id=d.peer_id, local_steps=True)
        d.state, d.tokens, d.worker.version = "active", 4096, 12
        body = _get(url)[2]
        labels = f'peer="{d.peer_id}",stage="1"'
        assert (
            f"anchormesh_peer_step{{{labels}}} 12" in body and f"anchormesh_peer_tokens_total{{{labels}}} 4096" in body
        )
        assert (
            "anchormesh_peer_loss" not in body and "anchormesh_peer_checkpoint_step" not in body
        )  # no loss yet (NaN), no checkpoint
        d.loss, d.checkpointer.written = 2.5, 10
        from peer.store.checkpoint import ShardCheckpoints

        d.checkpoints = ShardCheckpoints(tmp_path, "run", 1)
        body = _get(url)[2]
        assert (
            f"anchormesh_peer_loss{{{labels}}} 2.5" in body
            and f"anchormesh_peer_checkpoint_step{{{labels}}} 10" in body
        )
        assert not math.isnan(d.metrics()["loss"])
    finally:
        server.shutdown()
        server.server_close()
        d.transport.close()
