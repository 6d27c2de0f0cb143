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
