"""How fast the data plane can feed one stage-0 peer over loopback: `python -m peer.bench.data_feed`.

Two figures, against a real tracker (gRPC on 127.0.0.1, tracker.json saved before every reply
that changed the data order, as the bootstrap does):
- download: Tracker.GetData of every training shard, hash-checked (peer/dataset/fetch.py);
- feed: work ids through the heartbeat exchange (hand out, release, reply) and micro-batches
  taken from the fetched shards (peer/daemon/feed.py), as fast as the peer can take them.
Both in tokens/s; compare with what a stage consumes (`status`'s tokens/s of a stage-0 peer).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from bootstrap.persist import StateSaver
from bootstrap.run_data import DataFiles, data_order
from bootstrap.server import serve_tracker
from bootstrap.tracker import Tracker
from peer.config import ModelConfig, PipelineConfig, TrainConfig
from peer.daemon.feed import READY_STEPS, WorkFeed
from peer.dataset.fetch import ShardStore, TrackerSource
from peer.dataset.prepare import prepare
from peer.dataset.shards import PreparedData
from peer.security import auth
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg
from peer.wire.version import build_fields


def _corpus(path: Path, n_bytes: int) -> None:
    rng = np.random.default_rng(0)
    words = np.array("the swarm trains one model over slow links while peers come and go".split())
    with path.open("w") as f:
        written = 0
        while written < n_bytes:
            doc = " ".join(rng.choice(words, size=int(rng.integers(100, 400)))) + "\n\n"
            f.write(doc)
            written += len(doc)


def measure(work: Path, mbytes: int, seq_len: int, micro_batch_size: int, micro_batches: int, seconds: float) -> dict:
    _corpus(work / "corpus.txt", mbytes << 20)
    prepare(
        str(work / "corpus.txt"),
        "bytes",
        work / "data",
        shard_tokens=1 << 22,
        eval_fraction=0.01,
        confirm_fraction=0.01,
        show_progress=False,
    )
    data = PreparedData(work / "data")
    cfg = TrainConfig(
        model=ModelConfig(num_stages=2, num_layers=2, max_seq_len=max(seq_len, 256)),
        pipeline=PipelineConfig(seq_len=seq_len, micro_batch_size=micro_batch_size, micro_batches=micro_batches),
    )
    tracker = Tracker("run-bench", cfg)
    tracker.data, tracker.eval_windows = data_order(data, cfg)
    tracker.data_manifest = data.manifest.to_json().decode()
    saver = StateSaver(tracker, work, {})
    # its one joiner announces no Stage server (it only fetches data): no dial-back
    server, address = serve_tracker(
        tracker, "127.0.0.1", 0, files=DataFiles(data), commit=saver.commit, dial_back=False
    )
    out: dict = {
        "seq_len": seq_len,
        "windows_per_step": micro_batches * micro_batch_size,
        "train_tokens": data.manifest.splits["train"].tokens,
    }
    try:
        channel = auth.open_channel(address, None)
        stub = pbg.TrackerStub(channel)
        a = stub.Join(pb.JoinRequest(peer_id="bench", grpc_address="127.0.0.1:1", **build_fields()), timeout=10)
        fetch = lambda name, offset: stub.GetData(pb.DataRequest(name=name, offset=offset), timeout=600)  # noqa: E731
        store = ShardStore(data.manifest, work / "cache", TrackerSource(fetch), keep=1 << 10)
        t0 = time.perf_counter()
        for shard in data.manifest.splits["train"].shards:
            store.ensure(shard)
        dt = time.perf_counter() - t0
        out["download_tokens_per_s"] = round(data.manifest.splits["train"].tokens / dt)
        out["download_mbyte_per_s"] = round(store.downloaded / dt / 1e6, 1)
        per_step = micro_batches * micro_batch_size
        feed = WorkFeed(store, a.data_windows, seq_len, READY_STEPS * per_step)
        stop = threading.Event()

        def reports():
            while not stop.is_set():
                held, returned = feed.for_report()
                step = feed.trained // per_step  # what a stage-0 peer reports: its steps and their tokens
                yield pb.PeerReport(
                    run_id="run-bench",
                    tokens=step * per_step * seq_len,
                    peer=pb.PeerInfo(peer_id="bench", stage=0, state="active", step=step),
                    windows_held=held,
                    windows_returned=returned,
                )
                if feed.hungry.wait(1.0):
                    feed.hungry.clear()

        def replies():
            try:
                for d in stub.Heartbeat(reports()):
                    feed.acked()
                    feed.add(d.windows)
            except grpc.RpcError:
                pass  # the measurement ended: the channel closed

        threading.Thread(target=replies, daemon=True).start()
        taken, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if feed.take(micro_batch_size) is not None:
                taken += micro_batch_size
            else:
                time.sleep(0.0005)
        dt = time.perf_counter() - t0
        stop.set()
        out["feed_tokens_per_s"] = round(taken * seq_len / dt)
        out["feed_windows_per_s"] = round(taken / dt)
        out["tracker_position"] = tracker.data.cursor
        channel.close()
    finally:
        server.stop(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=int, default=64, help="text to prepare (byte tokens: as many tokens)")
    ap.add_argument("--seconds", type=float, default=5.0, help="how long the feed is measured")
    args = ap.parse_args()
    rows = []
    for seq_len, mbs, mb in ((128, 8, 2), (2048, 8, 2)):  # the tiny run's shape, the recommended run's
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(Path(tmp), args.mbytes, seq_len, mbs, mb, args.seconds))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
