"""The run's prepared data on the bootstrap: found or made at start, its order handed to the
tracker, its files served to stage-0 peers (`Tracker.GetData`).

Where the data comes from, in order: `data.prepared` (a folder written by `anchormesh data
prepare`, checked against its manifest at start, or `hf://OWNER/NAME[@REVISION]`, such a folder
uploaded to a Hugging Face dataset repo: only its manifest is read here, at a commit pinned for
the run, and stage-0 peers download their shards from the hub); else the bootstrap prepares `data.path`, the
Hugging Face dataset `data.dataset`, or the built-in corpus itself, once, into
`STATE_DIR/data` (at most `data.max_bytes` of text), and a restart takes that folder again.
Stage-0 peers never read a path the run config names: they get the shards from here (or the hub).
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from bootstrap.data_order import DataOrder
from peer.config import TrainConfig
from peer.dataset.hub import HubData, is_hub, open_hub_data, parse_hub
from peer.dataset.manifest import DEFAULT_MIN_HELDOUT_TOKENS, MANIFEST, SPLITS
from peer.dataset.shards import PreparedData
from peer.errors import ConfigError
from peer.wire import anchormesh_pb2 as pb

log = logging.getLogger("anchormesh.bootstrap")
CHUNK_BYTES = 1 << 20  # one DataChunk's payload: under every channel's message limit
MAX_DOWNLOADS = 8  # GetData streams served at once: each holds a server thread
LEASE_STEPS = 4  # a stage-0 peer holds this many of its steps' windows ahead
MAX_LEASE = 256  # ... but at most this many work ids (its reports list them: the heartbeat's size bound)
HUB_PIN = "hub-data.pin"  # in the state dir: the commit a run on hub data is pinned to (kept across restarts)


def tokenizer_name(config: TrainConfig) -> str:
    """The name `data prepare` records for the run's tokenizer: `bytes`, or the model's name."""
    return "bytes" if config.data.tokenizer == "bytes" else config.model.name


def _source(config: TrainConfig, folder: Path) -> str:
    """The SOURCE `data prepare` reads for this run (the built-in corpus is written out first)."""
    d = config.data
    if d.path:
        return d.path
    if d.dataset:
        return f"hf:{d.dataset}:{d.dataset_config}:{d.split}"
    from peer.data import default_corpus

    text, where = default_corpus("b", d.max_bytes)
    corpus = folder.parent / "builtin-corpus.txt"
    corpus.write_bytes(text)
    log.info("preparing the built-in corpus (%s, %d bytes)", where.split(",")[0], len(text))
    return str(corpus)


def open_run_data(config: TrainConfig, state_dir: Path) -> PreparedData | HubData:
    """The run's prepared data, checked (hashes included) against its manifest and the run's
    tokenizer; for data on the hub, its manifest at the run's pinned commit."""
    from peer.dataset.prepare import prepare

    tok = tokenizer_name(config)
    if is_hub(config.data.prepared):
        return open_hub_data(parse_hub(config.data.prepared), tok, state_dir / HUB_PIN)
    if config.data.prepared:
        return PreparedData(config.data.prepared, tokenizer=tok, verify=True)
    folder = state_dir / "data"
    if (folder / MANIFEST).is_file():
        return PreparedData(folder, tokenizer=tok, verify=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    source = _source(config, folder)
    try:
        half = (
            config.data.heldout / 2
        )  # documents held out: half for the evaluation passes, half as the confirmation set
        p = config.pipeline  # each held-out split needs one evaluation pass's windows (at most the default minimum)
        least = min(DEFAULT_MIN_HELDOUT_TOKENS, p.eval_batches * p.micro_batch_size * (p.seq_len + 1))
        prepare(
            source,
            tok,
            folder,
            force=True,
            max_bytes=config.data.max_bytes,
            shard_tokens=config.data.shard_tokens,
            show_progress=False,
            text_field=config.data.text_field,
            eval_fraction=half,
            confirm_fraction=half,
            min_heldout_tokens=least,
        )
    except ConfigError as exc:
        raise ConfigError("data", source, f"the bootstrap cannot prepare the run's data: {exc}") from None
    finally:
        if not config.data.path and not config.data.dataset:
            (folder.parent / "builtin-corpus.txt").unlink(missing_ok=True)
    return PreparedData(folder, tokenizer=tok, verify=True)


def data_order(data: PreparedData | HubData, config: TrainConfig) -> tuple[DataOrder, int]:
    """A new run's data order over `data`'s training windows, and how many eval windows it uses."""
    p = config.pipeline
    windows = data.windows(p.seq_len)
    lease = min(MAX_LEASE, max(LEASE_STEPS * p.micro_batches * p.micro_batch_size, p.micro_batch_size))
    order = DataOrder(
        windows.count,
        p.seq_len,
        seed=config.seed,
        lease=lease,
        source=data.manifest.source,
        budget=budget_windows(config),
        shard_ends=windows.shard_ends,
    )
    return order, eval_count(data, config)


def budget_windows(config: TrainConfig) -> int:
    """The token budget in windows (0: none), rounded up to whole steps of one stage-0 peer, so
    that the last windows handed out fill a step and the run can end."""
    p = config.pipeline
    if config.token_budget <= 0:
        return 0
    step = p.micro_batches * p.micro_batch_size
    return -(-config.token_budget // (p.seq_len * step)) * step


def eval_count(data: PreparedData | HubData, config: TrainConfig) -> int:
    p = config.pipeline
    return min(p.eval_batches * p.micro_batch_size, data.windows(p.seq_len, "eval").count)


class DataFiles:
    """`Tracker.GetData`: any file the manifest names, in chunks, from an offset. Nothing else
    on the bootstrap's disk is reachable: names are looked up in the manifest, never joined to a
    path as given."""

    def __init__(self, data: PreparedData) -> None:
        self.folder = data.folder
        self.files = {
            s.name: s.tokens * data.dtype.itemsize for split in SPLITS for s in data.manifest.splits[split].shards
        }
        self.files.update({s.index: s.documents * 8 for split in SPLITS for s in data.manifest.splits[split].shards})
        self._slots = threading.BoundedSemaphore(MAX_DOWNLOADS)
        self.bytes_out = 0

    def GetData(self, request: pb.DataRequest, context: grpc.ServicerContext) -> Iterator[pb.DataChunk]:
        size = self.files.get(request.name)
        if size is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND, f"name={request.name[:80]!r}: not a file of this run's prepared data"
            )
        if request.offset > size:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"offset={request.offset}: {request.name} has {size} bytes")
        if not self._slots.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_DOWNLOADS} data downloads are running; try again shortly"
            )
        try:
            with (self.folder / request.name).open("rb") as f:
                f.seek(request.offset)
                offset = request.offset
                while context.is_active():
                    block = f.read(min(CHUNK_BYTES, size - offset))
                    if not block:
                        break
                    self.bytes_out += len(block)
                    yield pb.DataChunk(name=request.name, total_bytes=size, offset=offset, data=block)
                    offset += len(block)
        finally:
            self._slots.release()


def drop_prepared(state_dir: Path) -> None:
    """A new run on a state dir: the old run's prepared data and hub pin go (they may come from another config)."""
    shutil.rmtree(state_dir / "data", ignore_errors=True)
    (state_dir / HUB_PIN).unlink(missing_ok=True)
