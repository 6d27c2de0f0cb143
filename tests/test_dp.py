"""Compressed DP sync (peer/dp): exact means, compression math, byte formulas, bad input."""

from __future__ import annotations

import pytest
import torch

from peer.config import DPConfig
from peer.dp import DenseSync, DiLoCoSync, Int8Sync, PowerSGDSync, build_dp_sync
from peer.dp.diloco import split_fragments
from peer.errors import ConfigError, TensorError

SHAPES = [torch.Size([256, 128]), torch.Size([128])]


def rand_replicas(shapes, replicas, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [[scale * torch.randn(s, generator=gen) for s in shapes] for _ in range(replicas)]


def clone2(x):
    return [[t.clone() for t in ts] for ts in x]


def flat_state(d):
    """All tensors of a state_dict in a stable order (None -> marker), for before/after comparisons."""
    out = []
    if isinstance(d, torch.Tensor):
        return [d]
    if isinstance(d, dict):
        for k in sorted(d):
            out += flat_state(d[k])
    elif isinstance(d, list):
        for v in d:
            out += flat_state(v)
    else:
        out.append(d)
    return out


def same_state(a, b):
    fa, fb = flat_state(a), flat_state(b)
    return len(fa) == len(fb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        for x, y in zip(fa, fb)
    )


# --- factory ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "scheme,cls", [("dense", DenseSync), ("powersgd", PowerSGDSync), ("int8", Int8Sync), ("diloco", DiLoCoSync)]
)
def test_factory_builds_each_scheme(scheme, cls):
    sync = build_dp_sync(DPConfig(replicas=2, scheme=scheme, rank=8), SHAPES)
    assert type(sync) is cls
    assert sync.dense_bytes() == 4 * (256 * 128 + 128)


# --- dense --------------------------------------------------------------------------------------
def test_dense_is_exact_mean_and_counts_fp32_bytes():
    grads = rand_replicas(SHAPES, 3)
    expected = [torch.stack([g[i] for g in grads]).mean(0) for i in range(len(SHAPES))]
    sync = build_dp_sync(DPConfig(replicas=3, scheme="dense"), SHAPES)
    nbytes = sync.sync_grads(0, grads)
    assert nbytes == 4 * (256 * 128 + 128) == sync.dense_bytes()
    for g in grads:
        for got, want in zip(g, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert all(torch.equal(grads[0][i], grads[r][i]) for r in range(3) for i in range(2))


def test_single_replica_is_a_no_op():
    grads = rand_replicas(SHAPES, 1)
    before = clone2(grads)
    for scheme in ("dense", "powersgd", "int8"):
        sync = build_dp_sync(DPConfig(replicas=1, scheme=scheme, rank=8), SHAPES)
        assert sync.sync_grads(0, grads) == 0
        assert all(torch.equal(a, b) for a, b in zip(grads[0], before[0]))


# --- powersgd -----------------------------------------------------------------------------------
def low_rank_plus_noise(m, n, rank, replicas, noise, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, rank, generator=gen)
    return [a @ torch.randn(rank, n, generator=gen) + noise * torch.randn(m, n, generator=gen) for _ in range(replicas)]


def accumulated_error(error_feedback, steps=50):
    m, n, r, replicas = 64, 48, 4, 3
    fixed = low_rank_plus_noise(m, n, r, replicas, noise=0.3, seed=0)
    true = torch.stack(fixed).mean(0)
    cfg = DPConfig(replicas=replicas, scheme="powersgd", rank=r, error_feedback=error_feedback)
    sync = build_dp_sync(cfg, [torch.Size([m, n])])
    acc = torch.zeros(m, n)
    history = []
    for step in range(steps):
        grads = [[g.clone()] for g in fixed]
        sync.sync_grads(step, grads)
        acc += true - grads[0][0]
        history.append(float(acc.norm() / true.norm()))
    return history, sync, acc


def test_powersgd_error_feedback_bounds_accumulated_error():
    ef, sync, acc = accumulated_error(True)
    no_ef, _, _ = accumulated_error(False)
    # without EF the noise outside rank r is dropped every step: the accumulated error grows linearly
    assert no_ef[49] / no_ef[24] > 1.8
    # with EF it is re-sent later: the accumulated error stays bounded and ends well below no-EF
    assert ef[49] / ef[24] < 1.2
    assert ef[49] < 0.5 * no_ef[49]
    # and it is exactly the mean of the replicas' residual buffers (nothing leaks)
    errors = sync.state_dict()["errors"]
    torch.testing.assert_close(acc, torch.stack([e[0] for e in errors]).mean(0), rtol=1e-4, atol=1e-4)


def test_powersgd_exact_on_rank_r_gradients():
    m, n, r, replicas = 96, 40, 6, 3
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(m, r, generator=gen)
    fixed = [a @ torch.randn(r, n, generator=gen) for _ in range(replicas)]  # shared column space
    true = torch.stack(fixed).mean(0)
    sync = build_dp_sync(DPConfig(replicas=replicas, scheme="powersgd", rank=r), [torch.Size([m, n])])
    for step in range(3):
        grads = [[g.clone()] for g in fixed]
        sync.sync_grads(step, grads)
        rel = float((grads[0][0] - true).norm() / true.norm())
        assert rel < 1e-4, (step, rel)
    # a rank-(r-2) sync of the same gradients cannot be exact: the test above can fail
    lossy = build_dp_sync(DPConfig(replicas=replicas, scheme="powersgd", rank=r - 2), [torch.Size([m, n])])
    grads = [[g.clone()] for g in fixed]
    lossy.sync_grads(0, grads)
    assert float((grads[0][0] - true).norm() / true.norm()) > 1e-2


def test_powersgd_bytes_match_formula():
    shapes = [torch.Size([256, 128]), torch.Size([128]), torch.Size([32, 4, 4]), torch.Size([16, 16])]
    r = 8
    sync = build_dp_sync(DPConfig(replicas=2, scheme="powersgd", rank=r), shapes)
    # [16,16] at rank 8: r*(m+n) = 256 >= 256 -> dense; [32,4,4] is viewed as [32,16]
    assert sync.compressed == [True, False, True, False]
    want = 4 * r * (256 + 128) + 4 * 128 + 4 * r * (32 + 16) + 4 * 256
    assert sync.expected_bytes() == want
    got = sync.sync_grads(0, rand_replicas(shapes, 2))
    assert got == want
    dense = 4 * sum(s.numel() for s in shapes)
    assert sync.dense_bytes() == dense
    assert sync.dense_bytes() / got == pytest.approx(dense / want)


@pytest.mark.parametrize("rank,ratio", [(8, 131584 / 12800), (64, 131584 / 98816)])
def test_powersgd_ratio_on_reference_shapes(rank, ratio):
    sync = build_dp_sync(DPConfig(replicas=2, scheme="powersgd", rank=rank), SHAPES)
    got = sync.sync_grads(0, rand_replicas(SHAPES, 2))
    assert got == 4 * rank * (256 + 128) + 4 * 128
    assert sync.dense_bytes() / got == pytest.approx(ratio)


def test_powersgd_state_roundtrip_continues_identically():
    cfg = DPConfig(replicas=2, scheme="powersgd", rank=4)
    a = build_dp_sync(cfg, SHAPES)
    a.sync_grads(0, rand_replicas(SHAPES, 2, seed=1))
    b = build_dp_sync(cfg, SHAPES)
    b.load_state_dict(a.state_dict())
    ga, gb = rand_replicas(SHAPES, 2, seed=2), rand_replicas(SHAPES, 2, seed=2)
    a.sync_grads(1, ga)
    b.sync_grads(1, gb)
    assert all(torch.equal(x, y) for x, y in zip(ga[0], gb[0]))


@pytest.mark.parametrize("scheme", ["int8", "diloco"])
def test_state_roundtrip_continues_identically(scheme):
    cfg = DPConfig(replicas=2, scheme=scheme, inner_steps=2, outer_compression="int8")
    a, b = build_dp_sync(cfg, SHAPES), build_dp_sync(cfg, SHAPES)
    if scheme == "diloco":
        pa = [[torch.zeros(s) for s in SHAPES] for _ in range(2)]
        a.init_params(pa)
        run_inner_steps(pa, 2, a)
        b.load_state_dict(a.state_dict())
        pb = clone2(pa)
        run_inner_steps(pa, 2, a, seed=7, start=2)
        run_inner_steps(pb, 2, b, seed=7, start=2)
        assert all(torch.equal(x, y) for x, y in zip(pa[0], pb[0]))
    else:
        a.sync_grads(0, rand_replicas(SHAPES, 2, seed=1))
        b.load_state_dict(a.state_dict())
        ga, gb = rand_replicas(SHAPES, 2, seed=2), rand_replicas(SHAPES, 2, seed=2)
        a.sync_grads(1, ga)
        b.sync_grads(1, gb)
        assert all(torch.equal(x, y) for x, y in zip(ga[0], gb[0]))
    with pytest.raises(TensorError, match="scheme"):
        build_dp_sync(DPConfig(replicas=2, scheme="dense"), SHAPES).load_state_dict(a.state_dict())


# --- int8 ---------------------------------------------------------------------------------------
def test_int8_bytes_formula():
    shapes = [torch.Size([256, 128]), torch.Size([128]), torch.Size([400])]
    sync = build_dp_sync(DPConfig(replicas=2, scheme="int8"), shapes)
    # 1 byte/element + 8 (codebook length) + 256*4 (codebook) per tensor; <=344 elements go fp32
    want = (256 * 128 + 1032) + 4 * 128 + (400 + 1032)
    assert sync.expected_bytes() == want
    assert sync.sync_grads(0, rand_replicas(shapes, 2)) == want
    assert sync.dense_bytes() / want == pytest.approx(4 * (256 * 128 + 128 + 400) / want)


def int8_running_average_error(error_feedback, steps=200):
    heavy = torch.distributions.StudentT(2.0)
    torch.manual_seed(1)
    fixed = [heavy.sample((4096,)) for _ in range(3)]  # outliers beyond +-3 sigma get clipped
    true = torch.stack(fixed).mean(0)
    sync = build_dp_sync(DPConfig(replicas=3, scheme="int8", error_feedback=error_feedback), [torch.Size([4096])])
    total = torch.zeros(4096)
    errs = {}
    for step in range(steps):
        grads = [[g.clone()] for g in fixed]
        sync.sync_grads(step, grads)
        total += grads[0][0]
        if step + 1 in (10, 50, steps):
            errs[step + 1] = float((total / (step + 1) - true).norm() / true.norm())
    return errs


def test_int8_error_feedback_running_average_converges_to_true_mean():
    ef = int8_running_average_error(True)
    no_ef = int8_running_average_error(False)
    assert ef[200] < ef[50] < ef[10]
    assert ef[200] < 0.02
    assert no_ef[200] > 0.1  # clipping bias that never goes away
    assert no_ef[200] == pytest.approx(no_ef[10])


def test_int8_single_step_is_close_and_identical_on_replicas():
    grads = rand_replicas(SHAPES, 3, seed=5)
    expected = [torch.stack([g[i] for g in grads]).mean(0) for i in range(2)]
    build_dp_sync(DPConfig(replicas=3, scheme="int8"), SHAPES).sync_grads(0, grads)
    assert float((grads[0][0] - expected[0]).norm() / expected[0].norm()) < 0.05
    torch.testing.assert_close(grads[0][1], expected[1], rtol=0, atol=1e-6)  # small: fp32
    assert all(torch.equal(grads[0][i], grads[2][i]) for i in range(2))


# --- diloco -------------------------------------------------------------------------------------
def run_inner_steps(params, steps, sync, seed=0, start=0):
    """Each replica takes a different random 'optimizer step'; returns bytes per step and the pre-sync means."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(start, start + steps):
        with torch.no_grad():
            for rp in params:
                for p in rp:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
        means = [torch.stack([rp[i] for rp in params]).mean(0) for i in range(len(params[0]))]
        nbytes = sync.sync_params(step, params)
        out.append((nbytes, means))
    return out


def test_diloco_plain_averaging_every_h_steps():
    cfg = DPConfig(
        replicas=3, scheme="diloco", inner_steps=4, outer_lr=1.0, outer_momentum=0.0, outer_compression="none"
    )
    sync = build_dp_sync(cfg, SHAPES)
    params = [[torch.zeros(s) for s in SHAPES] for _ in range(3)]
    sync.init_params(params)
    assert sync.sync_grads(0, rand_replicas(SHAPES, 3)) == 0
    log = run_inner_steps(params, 8, sync)
    assert [b for b, _ in log] == [0, 0, 0, sync.dense_bytes(), 0, 0, 0, sync.dense_bytes()]
    # after the last sync (step 7), every replica holds the mean of the replicas' params
    means = log[-1][1]
    for rp in params:
        for p, m in zip(rp, means):
            torch.testing.assert_close(p, m, rtol=0, atol=1e-6)


def test_diloco_nesterov_outer_step_matches_hand_computation():
    lr, mu = 0.7, 0.9
    cfg = DPConfig(replicas=2, scheme="diloco", inner_steps=2, outer_lr=lr, outer_momentum=mu, outer_compression="none")
    shapes = [torch.Size([3])]
    sync = build_dp_sync(cfg, shapes)
    params = [[torch.zeros(3)], [torch.zeros(3)]]
    sync.init_params(params)
    theta, v = torch.zeros(3), torch.zeros(3)
    for step, (u0, u1) in enumerate([(1.0, 3.0), (0.0, 0.0), (2.0, 0.0), (1.0, 1.0)]):
        params[0][0] += u0
        params[1][0] += u1
        if (step + 1) % 2 == 0:
            delta = theta - (params[0][0] + params[1][0]) / 2
            v = mu * v + delta
            theta = theta - lr * (delta + mu * v)
        sync.sync_params(step, params)
    torch.testing.assert_close(params[0][0], theta)
    torch.testing.assert_close(params[1][0], theta)
    assert not torch.equal(theta, torch.zeros(3))


def test_diloco_fragments_sync_at_different_steps():
    shapes = [torch.Size([64, 32]), torch.Size([2048]), torch.Size([16])]
    assert split_fragments([s.numel() for s in shapes], 2) == [[0], [1, 2]]
    cfg = DPConfig(
        replicas=2,
        scheme="diloco",
        inner_steps=4,
        fragments=2,
        outer_lr=1.0,
        outer_momentum=0.0,
        outer_compression="none",
    )
    sync = build_dp_sync(cfg, shapes)
    assert sync.offsets == [0, 2]
    params = [[torch.zeros(s) for s in shapes] for _ in range(2)]
    sync.init_params(params)
    log = run_inner_steps(params, 2, sync)  # steps 0, 1: fragment 1 syncs after step 1
    assert [b for b, _ in log] == [0, 4 * (2048 + 16)]
    assert torch.equal(params[0][1], params[1][1]) and torch.equal(params[0][2], params[1][2])
    assert not torch.equal(params[0][0], params[1][0])
    log = run_inner_steps(params, 2, sync, seed=1, start=2)  # steps 2, 3: fragment 0 syncs after step 3
    assert [b for b, _ in log] == [0, 4 * 64 * 32]
    assert torch.equal(params[0][0], params[1][0])
    assert not torch.equal(params[0][1], params[1][1])


def test_diloco_compressed_outer_bytes():
    for comp, want in [("int8", 256 * 128 + 1032 + 4 * 128), ("powersgd", 4 * 8 * (256 + 128) + 4 * 128)]:
        cfg = DPConfig(replicas=2, scheme="diloco", inner_steps=2, rank=8, outer_compression=comp)
        sync = build_dp_sync(cfg, SHAPES)
        params = [[torch.zeros(s) for s in SHAPES] for _ in range(2)]
        sync.init_params(params)
        assert [b for b, _ in run_inner_steps(params, 2, sync)] == [0, want]
        assert all(torch.equal(params[0][i], params[1][i]) for i in range(2))


def test_diloco_rejects_non_identical_start():
    sync = build_dp_sync(DPConfig(replicas=2, scheme="diloco"), SHAPES)
    params = rand_replicas(SHAPES, 2)
    with pytest.raises(TensorError, match="replica 1"):
        sync.init_params(params)


# --- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["dense", "powersgd", "int8"])
def test_bad_grads_raise_and_leave_state_untouched(scheme):
    sync = build_dp_sync(DPConfig(replicas=2, scheme=scheme, rank=4), SHAPES)
    sync.sync_grads(0, rand_replicas(SHAPES, 2, seed=3))  # non-trivial EF buffers / Q
    before = sync.state_dict()
    good = rand_replicas(SHAPES, 2, seed=4)

    with pytest.raises(TensorError, match="expected dp.replicas=2"):
        sync.sync_grads(1, good[:1])
    bad_shape = clone2(good)
    bad_shape[1][0] = torch.zeros(128, 256)
    with pytest.raises(TensorError, match=r"replica 1\]\[param 0\]: shape"):
        sync.sync_grads(1, bad_shape)
    nan = clone2(good)
    nan[1][1][5] = float("nan")
    with pytest.raises(TensorError, match=r"replica 1\]\[param 1\].*NaN"):
        sync.sync_grads(1, nan)
    assert torch.equal(nan[0][0], good[0][0])  # replica 0's grads not overwritten either
    assert same_state(before, sync.state_dict())
    # the same good input still goes through afterwards
    assert sync.sync_grads(1, good) > 0
    if scheme != "dense":
        assert not same_state(before, sync.state_dict())


def test_bad_params_leave_diloco_state_untouched():
    cfg = DPConfig(replicas=2, scheme="diloco", inner_steps=2, outer_compression="int8")
    sync = build_dp_sync(cfg, SHAPES)
    params = [[torch.zeros(s) for s in SHAPES] for _ in range(2)]
    sync.init_params(params)
    run_inner_steps(params, 2, sync)
    before = sync.state_dict()
    params[1][0][0, 0] = float("inf")
    with pytest.raises(TensorError, match=r"replica 1\]\[param 0\]"):
        sync.sync_params(3, params)  # a sync step
    assert same_state(before, sync.state_dict())


def test_rank_larger_than_a_matrix_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        build_dp_sync(DPConfig(replicas=2, scheme="powersgd", rank=200), SHAPES)
    assert info.value.field == "dp.rank"
    assert "parameter #0" in str(info.value) and "128" in str(info.value)
    with pytest.raises(ConfigError, match="dp.rank"):
        build_dp_sync(DPConfig(replicas=2, scheme="diloco", rank=200, outer_compression="powersgd"), SHAPES)


def test_too_many_fragments_is_a_config_error():
    with pytest.raises(ConfigError, match="dp.fragments"):
        build_dp_sync(DPConfig(replicas=2, scheme="diloco", inner_steps=10, fragments=3), SHAPES)
