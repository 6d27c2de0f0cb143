"""The tracker owns the data order (bootstrap/data_order.py): every window once per epoch across
the swarm, a dead or departed peer's unstarted work goes to another, and the position survives a
round trip through tracker.json."""

from __future__ import annotations

import json

from bootstrap import persist
from bootstrap.data_order import DataOrder
from bootstrap.tracker import Tracker
from peer.config import ModelConfig, TrainConfig
from peer.wire import anchormesh_pb2 as pb
from peer.wire.version import build_fields
from tests.test_tracker_restart import Clock  # a settable clock


def test_each_window_once_per_epoch_across_peers_in_a_seeded_order() -> None:
    d = DataOrder(windows=50, seq_len=8, seed=3, lease=4)
    trained: list[int] = []
    held = {"a": [], "b": []}
    for _ in range(40):  # each report releases what the peer held: it trains all of it
        for peer in ("a", "b"):
            trained += held[peer]
            held[peer] = d.report(peer, [], [])
    epochs = {}
    for wid in trained:
        epochs.setdefault(wid // 50, []).append(wid % 50)
    assert sorted(epochs[0]) == list(range(50)) and sorted(epochs[1]) == list(range(50))  # once per epoch
    assert len(trained) == len(set(trained))
    assert epochs[0][:8] != list(range(8))  # not the prepared order
    again = DataOrder(windows=50, seq_len=8, seed=3, lease=4)
    assert [int(x) for x in again.permutation(0)] == [int(x) for x in d.permutation(0)]  # the same after a restart
    assert d.tokens_seen == d.done * 8 and d.epoch >= 1


def test_with_several_shards_the_order_goes_shard_by_shard_and_survives_a_restart() -> None:
    """Peers fetch whole shards and keep a few: an epoch takes the shards in a seeded order and the
    windows of each in a seeded order, so a lease touches one shard, two at a boundary."""
    ends = [30, 60, 100, 130]
    d = DataOrder(windows=130, seq_len=8, seed=3, lease=8, shard_ends=ends)
    shard = [next(k for k, end in enumerate(ends) if w < end) for w in d.permutation(0)]
    runs = [shard[0]] + [b for a, b in zip(shard, shard[1:]) if b != a]
    assert sorted(runs) == [0, 1, 2, 3] and runs != [0, 1, 2, 3]  # each shard once, not in prepared order
    assert sorted(int(x) for x in d.permutation(0)) == list(range(130))
    assert list(d.permutation(0)[:30]) != sorted(d.permutation(0)[:30])  # shuffled inside the shard too
    assert list(d.permutation(1)) != list(d.permutation(0))
    leases = [d.report(peer, [], []) for _ in range(6) for peer in ("a", "b")]
    assert max(len({shard[list(d.permutation(0)).index(w)] for w in lease}) for lease in leases) <= 2
    again = DataOrder.from_dict(json.loads(json.dumps(d.to_dict())))
    assert again.shard_ends == ends and list(again.permutation(0)) == list(d.permutation(0))
    one = DataOrder(windows=50, seq_len=8, seed=3)  # one shard (or a run saved before): the plain permutation
    assert list(one.permutation(0)) == list(DataOrder(windows=50, seq_len=8, seed=3, shard_ends=[50]).permutation(0))


def test_a_peer_keeps_what_it_holds_and_gives_back_what_it_cannot_train() -> None:
    d = DataOrder(windows=100, seq_len=8, lease=6)
    first = d.report("a", [], [])
    assert len(first) == 6 and d.in_flight == 6
    # it starts two, still holds three, cannot get the shard of one
    more = d.report("a", first[2:5], [first[5]])
    assert d.done == 2 and len(more) == 3 and set(d.held["a"]) == set(first[2:5]) | set(more)
    assert d.returned == [first[5]]
    assert first[5] not in d.report("a", d.held["a"], [])  # not handed to the peer that gave it back
    b = d.report("b", [], [])
    assert b[0] == first[5]  # the next peer takes it first


def test_a_dead_peers_unstarted_work_goes_to_another_and_nothing_is_trained_twice() -> None:
    clock = Clock(100.0)
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4))
    t = Tracker("run-x", cfg, peer_timeout_s=10.0, clock=clock, data=DataOrder(windows=1000, seq_len=8, lease=8))
    for pid in ("a", "b", "c"):
        t.join(pb.JoinRequest(peer_id=pid, grpc_address=f"h:{pid}", **build_fields()))
    zero = sorted(pid for pid, p in t.peers.items() if p.stage == 0)
    assert len(zero) == 2
    x, y = zero

    def report(pid: str, held: list[int], returned: list[int] = ()) -> list[int]:
        p = t.peers[pid]
        return list(
            t.report(
                pb.PeerReport(
                    run_id="run-x",
                    peer=pb.PeerInfo(peer_id=pid, stage=p.stage, state="active"),
                    windows_held=held,
                    windows_returned=returned,
                )
            ).windows
        )

    wx, wy = report(x, []), report(y, [])
    assert len(wx) == len(wy) == 8 and not set(wx) & set(wy)
    trained = wx[:3]  # x releases three (it trains them), then dies holding five
    more = report(x, wx[3:])  # topped up to its lease again
    clock.t += 11
    wy2 = report(y, [])  # y trained all of its first lease; x has expired meanwhile
    assert t.peers[x].state == "dead" and x not in t.data.held
    assert set(wx[3:] + more) == set(wy2)  # x's unstarted work goes on, to y
    trained += wy + wy2
    assert len(trained) == len(set(trained))
    s = t.status()
    assert s.data.windows == 1000 and s.data.done == 3 + 8 and s.data.tokens_seen == 11 * 8 and s.data.in_flight == 8


def test_leave_restart_and_stop_give_back_the_work() -> None:
    cfg = TrainConfig(model=ModelConfig(num_stages=1, num_layers=2), token_budget=10**9)
    t = Tracker("run-x", cfg, data=DataOrder(windows=100, seq_len=8, lease=4))
    t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", **build_fields()), key=b"k" * 32)
    got = list(t.report(pb.PeerReport(run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active"))).windows)
    t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", **build_fields()), key=b"k" * 32)  # restarted: same key
    assert t.data.returned == got and "a" not in t.data.held
    again = list(
        t.report(pb.PeerReport(run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active"))).windows
    )
    assert again == got  # the restarted process takes the old one's unstarted work
    t.leave(pb.LeaveRequest(run_id="run-x", peer_id="a", reason="done"))
    assert t.data.returned == got and t.data.done == 0


def test_the_position_survives_a_round_trip_through_tracker_json() -> None:
    clock = Clock(1000.0)
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4))
    t = Tracker("run-x", cfg, clock=clock, data=DataOrder(windows=30, seq_len=8, seed=5, lease=4, source="corpus"))
    t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", **build_fields()))
    for _ in range(10):  # past an epoch; it reports the tokens of what it released
        tokens = t.data.released.get("a", 0) * 8
        held = list(
            t.report(
                pb.PeerReport(run_id="run-x", tokens=tokens, peer=pb.PeerInfo(peer_id="a", stage=0, state="active"))
            ).windows
        )
    data = json.loads(json.dumps(persist.snapshot(t, {})))
    r = persist.restore(data, clock=Clock(5.0))
    assert r.data.to_dict() == t.data.to_dict() and r.status().data == t.status().data
    assert r.status().data.epoch == 1 and r.status().data.source == "corpus"
    nxt = list(
        r.report(
            pb.PeerReport(run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active"), windows_held=held)
        ).windows
    )
    assert nxt == []  # it still holds its lease: the restored tracker knows it
    fresh = list(
        r.report(pb.PeerReport(run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active"))).windows
    )
    ref = list(t.report(pb.PeerReport(run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active"))).windows)
    assert fresh == ref  # the restored order continues where the saved one was


def test_status_json_and_table_show_the_data_position() -> None:
    from peer.client.status import render
    from peer.client.view import status_dict

    t = Tracker(
        "run-x",
        TrainConfig(model=ModelConfig(num_stages=2, num_layers=4)),
        data=DataOrder(windows=200, seq_len=8, lease=4, source="corpus"),
        eval_windows=16,
    )
    t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", **build_fields()))
    held = list(t.report(pb.PeerReport(run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active"))).windows)
    t.report(
        pb.PeerReport(run_id="run-x", peer=pb.PeerInfo(peer_id="a", stage=0, state="active"), windows_held=held[2:])
    )
    s = t.status()
    assert status_dict(s)["data"] == {
        "source": "corpus",
        "epoch": 0,
        "windows": 200,
        "position": 6,
        "done": 2,
        "tokens_seen": 16,
        "in_flight": 4,
        "returned": 0,
        "eval_windows": 16,
    }
    assert "data epoch 0, window 6 of 200 (3.0 %), 16 tokens seen, 4 in flight" in render(s)
    assert status_dict(Tracker("run-y", TrainConfig()).status())["data"] is None


def test_a_restarted_bootstrap_refuses_data_that_changed_under_its_run(tmp_path) -> None:
    import pytest

    from bootstrap.node import attach_data
    from bootstrap.run_data import open_run_data
    from peer.config import DataConfig, PipelineConfig
    from peer.errors import ConfigError

    (tmp_path / "a.txt").write_text("\n\n".join(f"document {i} " + "words of text " * 60 for i in range(600)))
    cfg = TrainConfig(
        model=ModelConfig(num_stages=2, num_layers=4),
        pipeline=PipelineConfig(seq_len=32),
        data=DataConfig(path=str(tmp_path / "a.txt")),
    )
    data = open_run_data(cfg, tmp_path / "boot")
    t = Tracker("run-x", cfg)
    attach_data(t, data)
    assert t.data.windows == data.windows(32).count and t.data_manifest and t.eval_windows == 4 * 8
    t.data.windows += 1  # the saved order was made over other data
    with pytest.raises(ConfigError, match=r"^data=.*training windows; the saved run's order covers"):
        attach_data(t, data)


def test_a_peer_that_releases_far_more_than_it_trains_gets_no_more_work() -> None:
    t = Tracker(
        "run-x",
        TrainConfig(model=ModelConfig(num_stages=2, num_layers=4)),
        data=DataOrder(windows=10_000, seq_len=8, lease=4),
    )
    t.join(pb.JoinRequest(peer_id="a", grpc_address="h:1", **build_fields()))

    def report(tokens: int) -> list[int]:
        return list(
            t.report(
                pb.PeerReport(run_id="run-x", tokens=tokens, peer=pb.PeerInfo(peer_id="a", stage=0, state="active"))
            ).windows
        )

    got = [report(0) for _ in range(7)]  # releases everything at once, trains nothing
    assert [len(g) for g in got] == [4, 4, 4, 4, 4, 4, 0] and t.data.released["a"] == 24  # 4 leases ahead: no more
    assert len(report(8 * 24)) == 4  # its tokens caught up: work again


def test_the_budget_caps_the_windows_handed_out_and_a_dead_peers_lost_windows_end_the_run() -> None:
    d = DataOrder(windows=1000, seq_len=8, lease=8, budget=20)
    a, b = d.report("a", [], []), d.report("b", [], [])
    assert len(a) == len(b) == 8
    assert len(d.report("a", [], [])) == 4  # a trained its 8: only 4 of the budget are left
    assert d.report("b", [], []) == [] and d.report("b", [], []) == []  # b trained its 8: none left for it
    assert d.done == 16 and d.in_flight == 4
    # a gives one back: it goes to b, though the budget has no room for fresh windows
    back = d.held["a"][-1]
    assert d.report("a", d.held["a"][:-1], [back]) == [] and d.report("b", [], []) == [back]
    # with a token budget on the tracker, a peer that dies after releasing windows it never trained
    # counts them as lost, so the run ends instead of waiting for their tokens
    clock = Clock(100.0)
    cfg = TrainConfig(model=ModelConfig(num_stages=2, num_layers=4), token_budget=16 * 8)
    t = Tracker(
        "run-x", cfg, peer_timeout_s=10.0, clock=clock, data=DataOrder(windows=1000, seq_len=8, lease=8, budget=16)
    )
    for pid in ("x", "y"):
        t.join(pb.JoinRequest(peer_id=pid, grpc_address=f"h:{pid}", **build_fields()))
    x = next(pid for pid, p in t.peers.items() if p.stage == 0)

    def report(held: list[int], tokens: int) -> pb.Directive:
        return t.report(
            pb.PeerReport(
                run_id="run-x", peer=pb.PeerInfo(peer_id=x, stage=0, state="active"), tokens=tokens, windows_held=held
            )
        )

    assert len(report([], 0).windows) == 8
    assert len(report([], 8 * 8).windows) == 8  # trained the first 8, released the next 8
    assert report([], 8 * 8).kind != pb.Directive.STOP and t.data.done == 16  # 8 of them not trained yet: no STOP
    clock.t += 11
    t.status()  # x expires
    assert t.data.lost == 8 and t._budget_spent()
    assert t.data.to_dict()["lost"] == 8 and DataOrder.from_dict(t.data.to_dict()).lost == 8
