"""`anchormesh bench swarm-quality`: its run.toml is the recommended run (or the dense-link one)
at the rows' sizes, the in-process rows train on the tracker's first windows, a swarm's score is
that of its peers' exit checkpoints, and a small real run ends at exactly its token budget."""

from __future__ import annotations

import copy
import json
import random
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bootstrap.data_order import DataOrder
from peer.bench import swarm_quality as sq
from peer.bench.swarm_quality_data import prepare_data, window_batches
from peer.bench.swarm_quality_run import swarm_toml
from peer.config import TrainConfig
from peer.errors import ConfigError
from peer.model.loading import load_causal_lm
from peer.model.stages import split_model
from peer.pipeline.local import evaluate_stages
from peer.runtoml import resolve_run

TINY = "tiny-llama"


def write_corpus(folder: Path, docs: int = 200) -> str:
    """`docs` documents of seeded random words: no two windows alike."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "stage", "peer", "token", "window", "shard", "link", "codec", "swarm"]
    folder.mkdir()
    for i in range(docs):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + " ".join(rng.choice(words) for _ in range(120)))
    return str(folder)


def tiny_setup(steps: int = 3):
    return replace(sq.setup_for(True, TINY), adapt_steps=steps, micro_batch_size=2, micro_batches=2, seq_len=32, seed=5)


def test_the_swarms_run_the_recommended_run_and_differ_only_in_their_links(tmp_path: Path) -> None:
    setup = tiny_setup()
    runs = {name: resolve_run(tomllib.loads(swarm_toml(TINY, setup, tmp_path, 2, name))).config for name in sq.SWARMS}
    rec, dense = runs["recommended"], runs["dense"]
    assert rec.mask == replace(
        resolve_run({"model": {"name": TINY}}).config.mask, seed=5
    )  # the defaults, the seed drawn
    assert dense.mask.scheme == "mask" and dense.mask.drop == 0.0 and dense.mask.seed == 5
    assert replace(dense, mask=rec.mask) == rec  # nothing else differs
    assert rec.pipeline.micro_batches == 1 and rec.token_budget == 3 * 2 * 2 * 32 and rec.data.prepared == str(tmp_path)
    with pytest.raises(ConfigError, match="--replicas"):
        swarm_toml(TINY, setup, tmp_path, 3, "recommended")


def test_the_rows_train_on_the_trackers_first_windows_each_once(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    setup = tiny_setup()
    data = prepare_data(folder, TINY, write_corpus(tmp_path / "corpus"), setup.seq_len)
    batch = window_batches(data, setup)
    windows = data.windows(setup.seq_len)
    rows = [batch(s, 0, j, bs=2, T=32) for s in range(3) for j in range(2)]
    first = DataOrder(windows.count, setup.seq_len, seed=5, shard_ends=windows.shard_ends).permutation(0)[:12]
    assert torch.equal(torch.cat(rows), torch.from_numpy(windows.batch([int(i) for i in first])))
    assert torch.equal(
        batch(1, 0, 1, bs=2, T=32), batch(1, 1, 1, bs=2, T=32)
    )  # the DP rows' numbering: the same windows
    anchor = batch(0, 99, 0, bs=2, T=32)
    assert not any(torch.equal(anchor[:1], r[k : k + 1]) for r in rows for k in range(2))
    with pytest.raises(ValueError, match="seq_len 16"):
        batch(0, 0, 0, bs=2, T=16)


def test_a_swarm_is_scored_on_its_averaged_stages_and_every_chain() -> None:
    cfg = TrainConfig().model
    base = load_causal_lm(cfg, seed=0)
    stages = split_model(copy.deepcopy(base), 2)
    params = [[p.detach().clone() for p in s.parameters()] for s in stages]
    shifted = [[p + 0.05 for p in ps] for ps in params]
    windows = [torch.randint(0, base.config.vocab_size, (2, 17))]
    got = sq.evaluate_swarm(
        base, {0: [("a", params[0]), ("b", params[0])], 1: [("c", params[1]), ("d", shifted[1])]}, windows
    )
    assert set(got["eval_loss_chains"]) == {"a + c", "a + d", "b + c", "b + d"}
    assert got["eval_loss_chains"]["a + c"] == pytest.approx(evaluate_stages(stages, windows))
    assert got["eval_loss_chains"]["a + c"] != pytest.approx(got["eval_loss_chains"]["a + d"])
    with pytest.raises(RuntimeError, match="does not fit stage 1"):
        sq.evaluate_swarm(base, {0: [("a", params[0])], 1: [("c", params[0])]}, windows)


@pytest.mark.processes
def test_a_small_swarm_trains_exactly_its_budget_and_is_scored_from_its_checkpoints(
    tmp_path: Path, monkeypatch
) -> None:
    setup = replace(tiny_setup(), adapt_steps=4)
    monkeypatch.setattr(sq, "setup_for", lambda quick, model=None: setup)
    out = sq.run_swarm_quality(
        TINY,
        tmp_path / "work",
        corpus=write_corpus(tmp_path / "corpus"),
        replicas=1,
        eval_windows=8,
        in_process=("dense",),
        swarms=("dense",),
        timeout_s=240,
        seq_len=None,
        chains=True,
    )
    swarm = out["swarm"]["dense"]
    assert (
        swarm["status"]["state"] == "done"
        and swarm["status"]["tokens"] == out["setup"]["token_budget"] == 4 * 2 * 2 * 32
    )
    assert swarm["status"]["pp_bytes_per_token"] > 0 and len(swarm["eval_loss_chains"]) == 1
    assert (
        swarm["eval_loss"] < out["pretrained"]["eval_loss"]
        and out["in_process"]["dense"]["eval_loss"] < out["pretrained"]["eval_loss"]
    )
    assert out["summary"]["swarm_gap"] is None  # one swarm: nothing to compare


def test_reuse_keeps_an_earlier_results_rows_only_for_the_same_setup(tmp_path: Path, monkeypatch) -> None:
    setup = tiny_setup()
    monkeypatch.setattr(sq, "setup_for", lambda quick, model=None: setup)
    corpus = write_corpus(tmp_path / "corpus")
    first = sq.run_swarm_quality(
        TINY, tmp_path / "a", corpus=corpus, eval_windows=8, in_process=(), swarms=(), seq_len=None
    )
    first = json.loads(json.dumps(first))  # as --reuse reads it back
    first["in_process"]["dense"] = {"eval_loss": 1.0, "pp_bytes_per_token": 2.0}
    again = sq.run_swarm_quality(
        TINY, tmp_path / "b", corpus=corpus, eval_windows=8, in_process=("dense",), swarms=(), reuse=first, seq_len=None
    )
    assert again["in_process"]["dense"] == {"eval_loss": 1.0, "pp_bytes_per_token": 2.0}  # kept, not run again
    with pytest.raises(ConfigError, match="--reuse"):
        sq.run_swarm_quality(
            TINY, tmp_path / "c", corpus=corpus, eval_windows=4, in_process=(), swarms=(), reuse=first, seq_len=None
        )
