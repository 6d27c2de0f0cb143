"""Stage 0's shards (peer/dataset/fetch.py, peer/daemon/feed.py, bootstrap/run_data.py): a shard
is used only when it matches the manifest (a wrong hash, a truncated or an oversized download is
refused and its work goes back to the tracker); `--data-dir` serves matching shards and never a
path outside it; the bootstrap serves only the files its manifest names."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from bootstrap.data_order import DataOrder
from bootstrap.run_data import DataFiles
from bootstrap.server import serve_tracker
from bootstrap.tracker import Tracker
from peer.config import ModelConfig, TrainConfig
from peer.daemon.feed import WorkFeed
from peer.dataset.fetch import ShardStore, TrackerSource
from peer.dataset.manifest import ShardError
from peer.dataset.prepare import prepare
from peer.dataset.shards import PreparedData
from peer.wire import anchormesh_pb2 as pb
from peer.wire import anchormesh_pb2_grpc as pbg

SEQ = 15  # windows of 16 tokens


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> PreparedData:
    tmp = tmp_path_factory.mktemp("prepared")
    rng = random.Random(0)
    text = "\n\n".join(
        " ".join(rng.choice("a swarm of peers trains one model".split()) for _ in range(rng.randint(20, 80)))
        for _ in range(300)
    )
    (tmp / "corpus.txt").write_text(text)
    prepare(
        str(tmp / "corpus.txt"),
        "bytes",
        tmp / "data",
        shard_tokens=4096,
        eval_fraction=0.1,
        confirm_fraction=0.1,
        min_heldout_tokens=200,
        show_progress=False,
    )
    return PreparedData(tmp / "data")


def serve(data: PreparedData):
    """What the bootstrap's GetData answers, without gRPC: a healthy download."""
    files = DataFiles(data)
    ctx = type(
        "Ctx",
        (),
        {"is_active": lambda self: True, "abort": lambda self, code, text: (_ for _ in ()).throw(RuntimeError(text))},
    )()
    return lambda name, offset: files.GetData(pb.DataRequest(name=name, offset=offset), ctx)


def test_a_download_matching_the_manifest_is_used_and_the_disk_holds_a_bounded_number(
    prepared: PreparedData, tmp_path: Path
) -> None:
    store = ShardStore(prepared.manifest, tmp_path / "cache", TrackerSource(serve(prepared)), keep=2)
    shards = prepared.manifest.splits["train"].shards
    assert len(shards) >= 4
    for s in shards[:4]:
        assert np.array_equal(store.tokens(s), prepared.tokens(s))
    assert (
        len(list((tmp_path / "cache").glob("*.bin"))) == 2 and store.downloaded == sum(s.tokens for s in shards[:4]) * 2
    )


@pytest.mark.parametrize(
    "damage, why",
    [("flip", "content differs"), ("cut", "truncated"), ("extra", "oversized"), ("size", "the server says")],
)
def test_a_bad_download_is_refused_and_leaves_nothing(
    prepared: PreparedData, tmp_path: Path, damage: str, why: str
) -> None:
    good = serve(prepared)

    def bad(name: str, offset: int):
        chunks = list(good(name, offset))
        last = chunks[-1]
        if damage == "flip":
            last.data = bytes([last.data[0] ^ 1]) + last.data[1:]
        elif damage == "cut":
            last.data = last.data[:-2]
        elif damage == "extra":
            chunks.append(
                pb.DataChunk(name=name, total_bytes=last.total_bytes, offset=last.offset + len(last.data), data=b"xx")
            )
        else:
            for c in chunks:
                c.total_bytes += 2
        return iter(chunks)

    store = ShardStore(prepared.manifest, tmp_path / "cache", TrackerSource(bad))
    with pytest.raises(ShardError, match=why):
        store.tokens(prepared.manifest.splits["train"].shards[0])
    assert not list((tmp_path / "cache").iterdir())


def test_work_on_a_shard_that_cannot_be_had_goes_back_and_the_rest_trains(
    prepared: PreparedData, tmp_path: Path
) -> None:
    good, broken = serve(prepared), prepared.manifest.splits["train"].shards[0].name

    def fetch(name: str, offset: int):
        if name == broken:
            return iter([pb.DataChunk(name=name, total_bytes=1, offset=0, data=b"x")])
        return good(name, offset)

    windows = prepared.windows(SEQ).count
    feed = WorkFeed(
        ShardStore(prepared.manifest, tmp_path / "cache", TrackerSource(fetch)), windows, SEQ, ready_target=8
    )
    per_shard = prepared.manifest.shard_tokens // (SEQ + 1)
    ids = [0, 1, per_shard, per_shard + 1, per_shard + 2]  # two in the broken shard 0, three in shard 1
    feed.add(ids)
    stop = threading.Event()
    t = threading.Thread(target=feed.prefetch, args=(stop,), daemon=True)
    t.start()
    for _ in range(100):
        held, returned = feed.for_report()
        feed.acked()
        if returned:
            break
        stop.wait(0.05)
    stop.set()
    t.join(5)
    assert sorted(returned) == [0, 1] and not held
    batch = feed.take(3)
    assert batch.shape == (3, SEQ + 1) and np.array_equal(batch.numpy(), prepared.windows(SEQ).batch(ids[2:]))


def test_released_work_trains_only_after_the_reply_and_a_broken_stream_puts_it_back(
    prepared: PreparedData, tmp_path: Path
) -> None:
    feed = WorkFeed(
        ShardStore(prepared.manifest, tmp_path / "cache", TrackerSource(serve(prepared))),
        prepared.windows(SEQ).count,
        SEQ,
        ready_target=4,
    )
    feed.add([5, 6, 7, 8, 9, 10])
    feed.store.ensure(prepared.manifest.splits["train"].shards[0])
    held, _ = feed.for_report()
    assert held == [9, 10] and feed.take(1) is None  # released 5..8, not usable before the reply
    feed.unacked()  # the stream broke: the report may never have arrived
    held, _ = feed.for_report()
    assert held == [9, 10]
    feed.acked()
    assert feed.take(4).shape == (4, SEQ + 1) and feed.take(1) is None


def test_data_dir_uses_matching_shards_and_refuses_paths_outside_it(prepared: PreparedData, tmp_path: Path) -> None:
    shards = prepared.manifest.splits["train"].shards
    mine, outside = tmp_path / "mine", tmp_path / "outside"
    mine.mkdir()
    outside.mkdir()
    (mine / shards[0].name).write_bytes((prepared.folder / shards[0].name).read_bytes())  # a good copy
    (mine / shards[1].name).write_bytes(b"\x00" * 10)  # not the run's
    (outside / shards[2].name).write_bytes((prepared.folder / shards[2].name).read_bytes())
    (mine / shards[2].name).symlink_to(outside / shards[2].name)  # right bytes, but outside the folder
    fetched: list[str] = []
    good = serve(prepared)

    def fetch(name: str, offset: int):
        fetched.append(name)
        return good(name, offset)

    store = ShardStore(prepared.manifest, tmp_path / "cache", TrackerSource(fetch), data_dir=mine)
    for s in shards[:3]:
        assert np.array_equal(store.tokens(s), prepared.tokens(s))
    assert fetched == [
        shards[1].name,
        shards[2].name,
    ]  # the good local copy was used; the others came from the bootstrap
    assert (mine / shards[0].name).exists()  # the volunteer's file is never deleted


def test_the_bootstrap_serves_only_the_manifests_files_to_members(prepared: PreparedData) -> None:
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4))
    t = Tracker("run-x", cfg, data=DataOrder(windows=prepared.windows(SEQ).count, seq_len=SEQ))
    server, address = serve_tracker(t, "127.0.0.1", 0, files=DataFiles(prepared))
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pbg.TrackerStub(ch)
            name = prepared.manifest.splits["eval"].shards[0].name
            data = b"".join(c.data for c in stub.GetData(pb.DataRequest(name=name), timeout=10))
            assert data == (prepared.folder / name).read_bytes()
            for bad in ("manifest.json", "../tracker.json", "/etc/passwd"):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.GetData(pb.DataRequest(name=bad), timeout=10))
                assert (
                    e.value.code() == grpc.StatusCode.NOT_FOUND
                    and "not a file of this run's prepared data" in e.value.details()
                )
    finally:
        server.stop(0)
