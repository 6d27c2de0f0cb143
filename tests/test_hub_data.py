"""Prepared data on a Hugging Face dataset repo (peer/dataset/hub.py): the bootstrap pins the
revision's commit and reads only the manifest; stage-0 peers download their shards from the hub
at that commit, each checked against the manifest (a wrong hash, a wrong size or a missing file is
refused and its work goes back), a bounded number kept on disk.

No real hub: a small HTTP server answers the calls huggingface_hub makes (HEAD and GET of
/datasets/OWNER/NAME/resolve/REVISION/FILE), with HF_ENDPOINT pointed at it."""

from __future__ import annotations

import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest

from bootstrap.node import attach_data
from bootstrap.run_data import HUB_PIN, open_run_data
from bootstrap.tracker import Tracker
from peer.config import DataConfig, ModelConfig, PipelineConfig, TrainConfig
from peer.daemon.feed import open_feed
from peer.dataset.fetch import ShardStore
from peer.dataset.hub import HubData, HubRef, HubSource, parse_hub
from peer.dataset.manifest import ShardError
from peer.dataset.prepare import prepare
from peer.dataset.shards import PreparedData
from peer.errors import ConfigError
from peer.runtoml import resolve_run
from peer.wire import anchormesh_pb2 as pb
from peer.wire.version import build_fields

SEQ = 15  # windows of 16 tokens
REPO = "my-org/run-data"
COMMIT, NEWER = "a" * 40, "b" * 40


class FakeHub(ThreadingHTTPServer):
    """One dataset repo: `commits` maps a commit to its files; `branches` a branch to a commit."""

    daemon_threads = True

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.commits = {COMMIT: dict(files)}
        self.branches = {"main": COMMIT}
        self.requests: list[tuple[str, str, str]] = []  # (method, revision, file)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body: bool) -> None:
        prefix = f"/datasets/{REPO}/resolve/"
        if not self.path.startswith(prefix):
            return self._error(404, "RepoNotFound")
        revision, _, name = self.path[len(prefix) :].partition("/")
        revision, name = unquote(revision), unquote(name)
        self.server.requests.append((self.command, revision, name))
        commit = self.server.branches.get(revision, revision)
        if commit not in self.server.commits:
            return self._error(404, "RevisionNotFound")
        data = self.server.commits[commit].get(name)
        if data is None:
            return self._error(404, "EntryNotFound", commit)
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{abs(hash(data)):x}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, code: int, why: str, commit: str = "") -> None:
        self.send_response(code)
        self.send_header("X-Error-Code", why)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> PreparedData:
    tmp = tmp_path_factory.mktemp("prepared")
    rng = random.Random(1)
    text = "\n\n".join(
        " ".join(
            rng.choice(["a", "swarm", "of", "peers", "trains", "one", "model", "from", "shards", "on", "the", "hub"])
            for _ in range(rng.randint(20, 80))
        )
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


@pytest.fixture
def hub(prepared: PreparedData, monkeypatch):
    from huggingface_hub import constants

    server = FakeHub({p.name: p.read_bytes() for p in prepared.folder.iterdir() if p.is_file()})
    monkeypatch.setattr(constants, "ENDPOINT", server.url)  # what HF_ENDPOINT sets when the library is imported
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _config(prepared_value: str) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(num_stages=2, num_layers=4),
        pipeline=PipelineConfig(seq_len=SEQ, micro_batch_size=2, micro_batches=2),
        data=DataConfig(prepared=prepared_value, tokenizer="bytes"),
    )


def test_the_run_toml_names_a_dataset_repo_and_a_bad_name_is_refused() -> None:
    assert parse_hub("hf://my-org/run-data") == HubRef("my-org/run-data", "main")
    assert parse_hub("hf://my-org/run-data@v1.0") == HubRef("my-org/run-data", "v1.0")
    assert DataConfig(prepared="hf://my-org/run-data@" + COMMIT).prepared.endswith(COMMIT)
    for bad in (
        "hf://run-data",
        "hf://my-org/run-data/extra",
        "hf://../etc@main",
        "hf://my-org/run-data@",
        "hf://my-org/run data",
    ):
        with pytest.raises(ConfigError, match="hf://OWNER/NAME|REVISION"):
            DataConfig(prepared=bad)
    with pytest.raises(ConfigError, match="leave data.path"):
        DataConfig(prepared="hf://my-org/run-data", path="corpus.txt")
    assert (
        resolve_run({"data": {"prepared": f"hf://{REPO}@v1"}}).config.data.prepared == f"hf://{REPO}@v1"
    )  # as run.toml says it
    with pytest.raises(ConfigError, match="data.prepared"):
        resolve_run({}, [f"data.prepared=hf://{REPO}@bad revision"])


def test_the_bootstrap_pins_the_commit_reads_only_the_manifest_and_keeps_the_pin(
    prepared: PreparedData, hub: FakeHub, tmp_path: Path
) -> None:
    cfg = _config(f"hf://{REPO}")
    data = open_run_data(cfg, tmp_path / "boot")
    assert isinstance(data, HubData) and data.ref == HubRef(REPO, COMMIT) and data.manifest == prepared.manifest
    assert {f for _, _, f in hub.requests} == {"manifest.json"}  # no shard on the bootstrap
    t = Tracker("run-x", cfg)
    attach_data(t, data)
    assert t.data.windows == prepared.windows(SEQ).count and t.data_hub == f"{REPO}@{COMMIT}"
    a = t.join(pb.JoinRequest(peer_id="p0", grpc_address="127.0.0.1:1", **build_fields()))
    assert a.stage == 0 and a.data_hub == f"{REPO}@{COMMIT}" and a.data_manifest
    hub.commits[NEWER], hub.branches["main"] = {}, NEWER  # the branch moves on (to a commit without the data)
    assert open_run_data(cfg, tmp_path / "boot").ref.revision == COMMIT  # a restart keeps the run's commit
    assert (tmp_path / "boot" / HUB_PIN).read_text().split() == [f"hf://{REPO}@main", COMMIT]
    with pytest.raises(ConfigError, match="holds no manifest.json"):
        open_run_data(cfg, tmp_path / "fresh")  # a new run takes the branch as it is now


def test_the_bootstrap_refuses_a_missing_repo_revision_or_another_tokenizer(hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such dataset repo"):
        open_run_data(_config("hf://my-org/other"), tmp_path / "a")
    with pytest.raises(ConfigError, match="no revision 'nope'"):
        open_run_data(_config(f"hf://{REPO}@nope"), tmp_path / "b")
    cfg = _config(f"hf://{REPO}")
    cfg.data.tokenizer = "model"  # the model's own tokenizer: the data was prepared with bytes
    with pytest.raises(ConfigError, match="prepared with tokenizer 'bytes'"):
        open_run_data(cfg, tmp_path / "c")


def test_a_peer_downloads_its_shards_at_the_pinned_commit_and_keeps_a_bounded_number(
    prepared: PreparedData, hub: FakeHub, tmp_path: Path
) -> None:
    store = ShardStore(
        prepared.manifest, tmp_path / "cache", HubSource(HubRef(REPO, COMMIT), tmp_path / "cache"), keep=2
    )
    shards = prepared.manifest.splits["train"].shards
    assert len(shards) >= 4
    hub.branches["main"] = NEWER  # moving the branch changes nothing: peers ask for the commit
    for s in shards[:4]:
        assert np.array_equal(store.tokens(s), prepared.tokens(s))
    assert {r for _, r, _ in hub.requests} == {COMMIT} and {f for _, _, f in hub.requests} == {
        s.name for s in shards[:4]
    }
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        s.name for s in shards[2:4]
    )  # nothing else left behind
    assert store.downloaded == sum(s.tokens for s in shards[:4]) * 2


@pytest.mark.parametrize(
    "damage, why",
    [
        ("flip", "content differs"),
        ("cut", "says 8190 bytes, the manifest says 8192"),
        ("extra", "says 8194 bytes"),
        ("gone", "cannot give it"),
    ],
)
def test_a_bad_shard_on_the_hub_is_refused_and_leaves_nothing(
    prepared: PreparedData, hub: FakeHub, tmp_path: Path, damage: str, why: str
) -> None:
    shard = prepared.manifest.splits["train"].shards[0]
    assert shard.tokens == 4096
    files, data = hub.commits[COMMIT], hub.commits[COMMIT][shard.name]
    if damage == "flip":
        files[shard.name] = bytes([data[0] ^ 1]) + data[1:]
    elif damage == "cut":
        files[shard.name] = data[:-2]
    elif damage == "extra":
        files[shard.name] = data + b"xx"
    else:
        del files[shard.name]
    store = ShardStore(prepared.manifest, tmp_path / "cache", HubSource(HubRef(REPO, COMMIT), tmp_path / "cache"))
    with pytest.raises(ShardError, match=why):
        store.tokens(shard)
    assert not list((tmp_path / "cache").iterdir())
    if damage in ("cut", "extra"):  # refused on the hub's word for its size: not a byte downloaded
        assert ("GET", COMMIT, shard.name) not in hub.requests


def test_a_peer_given_hub_data_gives_back_the_work_of_a_bad_shard_and_trains_the_rest(
    prepared: PreparedData, hub: FakeHub, tmp_path: Path
) -> None:
    cfg = _config(f"hf://{REPO}")
    broken = prepared.manifest.splits["train"].shards[0].name
    hub.commits[COMMIT][broken] = b"\x00" * len(hub.commits[COMMIT][broken])  # the right size, the wrong bytes
    windows = prepared.windows(SEQ).count
    a = pb.Assignment(
        data_manifest=prepared.manifest.to_json().decode(), data_windows=windows, data_hub=f"{REPO}@{COMMIT}"
    )
    feed = open_feed(a, cfg, None, tmp_path / "state", None, vocab_size=256)
    assert isinstance(feed.store.source, HubSource)
    feed.ready_target = 8
    per_shard = prepared.manifest.shard_tokens // (SEQ + 1)
    ids = [0, 1, per_shard, per_shard + 1, per_shard + 2]  # two in the broken shard 0, three in shard 1
    feed.add(ids)
    stop = threading.Event()
    t = threading.Thread(target=feed.prefetch, args=(stop,), daemon=True)
    t.start()
    returned: list[int] = []
    for _ in range(200):
        held, back = feed.for_report()
        feed.acked()
        returned += back
        if returned and not held:
            break
        stop.wait(0.05)
    stop.set()
    t.join(5)
    assert sorted(returned) == [0, 1]
    batch = feed.take(3)
    assert batch is not None and np.array_equal(batch.numpy(), prepared.windows(SEQ).batch(ids[2:]))
    feed.close()


def test_a_peer_takes_hub_data_only_at_a_commit(prepared: PreparedData, tmp_path: Path) -> None:
    a = pb.Assignment(
        data_manifest=prepared.manifest.to_json().decode(),
        data_windows=prepared.windows(SEQ).count,
        data_hub=f"{REPO}@main",
    )
    with pytest.raises(ConfigError, match="must name a commit"):
        open_feed(a, _config(""), None, tmp_path / "state", None, vocab_size=256)
    assert isinstance(
        ShardStore(prepared.manifest, tmp_path / "c", HubSource(HubRef(REPO, COMMIT), tmp_path / "c")).source, HubSource
    )


def test_an_unreachable_hub_is_tried_again_later_not_refused(
    prepared: PreparedData, hub: FakeHub, tmp_path: Path
) -> None:
    """A network failure is no verdict on the shard: OSError (the prefetch retries), not ShardError (work given back)."""
    from huggingface_hub import constants

    hub.shutdown()
    hub.server_close()
    constants.HUGGINGFACE_CO_URL_TEMPLATE = hub.url + "/{repo_id}/resolve/{revision}/{filename}"  # the closed port
    store = ShardStore(prepared.manifest, tmp_path / "cache", HubSource(HubRef(REPO, COMMIT), tmp_path / "cache"))
    with pytest.raises(OSError) as e:
        store.tokens(prepared.manifest.splits["train"].shards[0])
    assert not isinstance(e.value, ShardError) and not list((tmp_path / "cache").iterdir())
