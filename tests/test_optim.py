"""ZeRO-1 AdamW pieces: schedule, update == torch.optim.AdamW, exact clipping, ZeRO ranges, pool; DP = 2 training
is bit-identical to single-process training (the ordered grad sum)."""

import math

import pytest
import torch

from tidal.core.errors import ConfigError
from tidal.engine.layout import Layout, ParamSpec
from tidal.engine.optim import BufferPool, OptimConfig, ShardState, ZeroShape, adamw_update, clip_coefficient, lr_at


def test_lr_schedule_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_iters=4, total_iters=14)
    assert [lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 4) == 1.0
    assert lr_at(cfg, 9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(cfg, 14) == pytest.approx(0.1) and lr_at(cfg, 100) == pytest.approx(0.1)


def test_bad_hyperparameter_names_field():
    with pytest.raises(ConfigError, match="actor.grad_clip"):
        OptimConfig(grad_clip=0)


def test_adamw_update_matches_torch_adamw():
    cfg = OptimConfig(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, generator=g)
    ref = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([ref], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    specs = (ParamSpec("w", (50,), None),)
    st = ShardState.allocate(ZeroShape.of(specs, 1, 1, 0, 0), torch.float32, torch.device("cpu"), BufferPool(),
                             torch.Generator())
    st.master.copy_(w)
    st.exp_avg.zero_(), st.exp_avg_sq.zero_()
    for _ in range(5):
        grad = torch.randn(50, generator=g)
        ref.grad = grad.clone()
        opt.step()
        adamw_update(st, grad, cfg.lr, cfg)
    torch.testing.assert_close(st.master, ref.detach(), rtol=1e-6, atol=1e-7)
    assert st.step == 5


def test_clip_coefficient():
    cfg = OptimConfig(grad_clip=1.0)
    assert clip_coefficient(0.81, cfg) is None
    assert clip_coefficient(4.0, cfg) == pytest.approx(0.5, rel=1e-6)


@pytest.mark.parametrize("tp,dp", [(1, 3), (2, 5), (4, 7)])
def test_zero_ranges_partition_every_tp_shard(tp, dp):
    specs = (ParamSpec("a", (23, 16), 0), ParamSpec("b", (16, 10), 1), ParamSpec("n", (16,), None))
    lay = Layout(tp, dp, tuple(range(tp * dp)))
    for t in range(tp):
        shapes = [ZeroShape.of(specs, tp, dp, t, d) for d in range(dp)]
        for i, s in enumerate(specs):
            ranges = [sh.owned[i] for sh in shapes]
            assert ranges[0][0] == 0 and ranges[-1][1] == math.prod(s.tp_shape(tp, t))
            assert all(ranges[k][1] == ranges[k + 1][0] for k in range(dp - 1))
            assert ranges == [s.zero_range(lay, t, d) for d in range(dp)]


def test_pool_reuses_by_identity():
    pool = BufferPool()
    a = pool.take(100, torch.float32, torch.device("cpu"))
    pool.give(a)
    b = pool.take(80, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.numel() == 80
    assert pool.take(10, torch.float32, torch.device("cpu")).data_ptr() != a.data_ptr()


def test_dp2_training_is_bit_identical_to_single_process():
    import test_reshard as tr

    from tidal.engine.testing import free_port, run_ranks
    res = run_ranks(2, tr.train_through_reshard, [("tp=1,dp=2", "tp=1,dp=2", False)], 2, free_port())[0]
    _a, _b, exact, diff, worst = res[0]
    assert exact, f"DP 2 differs from single process: {diff:.3g} in {worst}"
