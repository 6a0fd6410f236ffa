"""The Megatron actor's optimizer state in megatron-core's own checkpoint format (real gloo worlds, CPU).

`MegatronBackend.save_megatron` writes weights and the DistributedOptimizer's state (fp32 main params, exp_avg,
exp_avg_sq, step; `fully_reshardable`) through dist_checkpointing; `load_megatron` reads them back at any (tp, dp).
What holds:
- same layout (world 1): every tensor of the global state (params, main params, both moments, step) and every
  param's torch AdamW `step` bit-identical after the load; one more iter after the load equals one more iter of
  the writer, bit for bit (so the step's bias correction and the LR position came back too);
- another layout (written at tp 2 x dp 1, read at tp 1 x dp 2, world 2): the global state bit-identical to the
  in-memory reshard of the writer to tp 1 x dp 2 (global Megatron coordinates are layout-free: the mapping is the
  identity there); the next iter's loss within 1e-6 relative of the writer's iter at tp 2 x dp 1 (the bound of
  tests/test_megatron_backend.py for a layout change: TP / DP reorder the sums) and its weights within 15% of one
  Adam step of the writer's;
- a weights-only checkpoint (the native backend's `save_megatron`) loads with the moments reset and says so
  (`CheckpointLoad.optimizer == "reset"`); `reset_optimizer=False` keeps the actor's own (`kept`).
Skipped when megatron-core is missing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tidal.engine.testing import run_ranks

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
pytestmark = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                "(pip install -e '.[megatron]')")

ARGS = dict(vocab_size=51, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
            max_seq_len=32, qkv_bias=True, qk_norm=True, head_dim=24)
LR = 1e-3


def _setup():
    from tidal.engine.model import ModelArgs
    from tidal.engine.optim import OptimConfig
    args = ModelArgs(**ARGS)
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, ARGS["vocab_size"], (2, 12), generator=g) for _ in range(4)]
    return args, OptimConfig(lr=LR, warmup_iters=1, total_iters=10, weight_decay=0.1, grad_clip=0.5), mbs, 4 * 2 * 11


def _adam_steps(backend) -> list[float]:
    """torch AdamW's per-param step of every param state on this rank."""
    return [float(s["step"]) for d in backend.stack.dopts for s in d.optimizer.state.values()]


def _same(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _world1(rank, world, root):
    from tidal.engine.actor import SharedQueue, nll_loss
    from tidal.engine.backends.protocol import make_backend
    from tidal.engine.layout import Layout

    args, hp, mbs, ntok = _setup()
    lay = Layout(1, 1, (0,))
    x = make_backend("megatron", args, hp, lay, 0, seed=1)
    for _ in range(2):
        x.train_iter(SharedQueue(mbs), nll_loss, ntok)
    x.save_megatron(f"{root}/full")
    before = x.state_dict_global()
    y = make_backend("megatron", args, hp, lay, 0, seed=2)   # other weights, no optimizer state yet
    loaded = y.load_megatron(f"{root}/full")
    after = y.state_dict_global()
    state_diff = _same(before, after)
    steps = (_adam_steps(x), _adam_steps(y), y.step)
    rx, ry = x.train_iter(SharedQueue(mbs), nll_loss, ntok), y.train_iter(SharedQueue(mbs), nll_loss, ntok)
    iter_diff = _same(x.state_dict_global(), y.state_dict_global())
    stepped = set(_adam_steps(y))

    # weights only: the native backend's Megatron checkpoint of the same weights
    nat = make_backend("native", args, hp, lay, 0, seed=1)
    nat.save_megatron(f"{root}/weights")
    reset = y.load_megatron(f"{root}/weights")
    s = y.state_dict_global()
    moments_zero = all(float(v.abs().max()) == 0 for k, v in s.items() if k.startswith("exp_avg"))
    y.train_iter(SharedQueue(mbs), nll_loss, ntok)   # moments nonzero again, step 1
    kept = y.load_megatron(f"{root}/weights", reset_optimizer=False)
    k = y.state_dict_global()
    kept_moments = all(torch.equal(s2, k[n]) for n, s2 in y_moments(k).items()) and \
        float(k["exp_avg/output_layer.weight"].abs().max()) > 0
    return (loaded, state_diff, steps, (rx.loss, ry.loss), iter_diff, stepped,
            reset, moments_zero, int(s["step"]), kept, int(k["step"]), kept_moments)


def y_moments(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.startswith("exp_avg")}


def test_megatron_optimizer_state_round_trip_same_layout(tmp_path):
    out = run_ranks(1, _world1, str(tmp_path), daemon=False, timeout=120)[0]
    (loaded, state_diff, (sx, sy, step), (lx, ly), iter_diff, stepped,
     reset, moments_zero, reset_step, kept, kept_step, kept_moments) = out
    assert loaded.optimizer == "checkpoint" and loaded.source == "megatron" and loaded.optimizer_step == 2, loaded
    assert state_diff == [] and step == 2            # params, main params, exp_avg, exp_avg_sq, step: bit for bit
    assert sx == sy and set(sy) == {2.0}             # torch AdamW's per-param steps too
    assert lx == ly and iter_diff == []              # the next iter: bit for bit
    assert stepped == {3.0}                          # each param's step advanced once (none shared)
    assert reset.optimizer == "reset" and moments_zero and reset_step == 0 and reset.optimizer_step == 0
    assert kept.optimizer == "kept" and kept_step == 1 and kept_moments


def _layout_change(rank, world, root):
    import torch.distributed as dist

    from tidal.engine.actor import SharedQueue, nll_loss
    from tidal.engine.backends.protocol import make_backend
    from tidal.engine.layout import Layout

    args, hp, mbs, ntok = _setup()
    a, b = Layout(2, 1, (0, 1)), Layout(1, 2, (0, 1))
    x = make_backend("megatron", args, hp, a, rank, seed=1)
    for _ in range(2):
        x.train_iter(SharedQueue(mbs), nll_loss, ntok)
    x.save_megatron(f"{root}/ckpt")
    dist.barrier()
    y = make_backend("megatron", args, hp, b, rank, seed=2, groups=x.groups)
    loaded = y.load_megatron(f"{root}/ckpt")
    x.reshard(b)
    ref, got = x.state_dict_global(), y.state_dict_global()
    state_diff = _same(ref, got)
    moments = float(got["exp_avg_sq/decoder.layers.0.self_attention.q_layernorm.weight"].abs().max())
    x.reshard(a)   # exact; the writer's next iter at its own layout
    rx, ry = x.train_iter(SharedQueue(mbs), nll_loss, ntok), y.train_iter(SharedQueue(mbs), nll_loss, ntok)
    wx, wy = x.state_dict_global(), y.state_dict_global()
    w_diff = max(float((wx[k] - wy[k]).abs().max()) for k in wx if k.startswith("param/"))
    return loaded, state_diff, moments, rx.loss, ry.loss, w_diff, set(_adam_steps(y))


def test_megatron_optimizer_state_loads_at_another_layout(tmp_path):
    """Written at tp 2 x dp 1, read at tp 1 x dp 2 (module doc)."""
    for loaded, state_diff, moments, lx, ly, w_diff, steps in run_ranks(2, _layout_change, str(tmp_path),
                                                                       daemon=False, timeout=120):
        assert loaded.optimizer == "checkpoint" and loaded.optimizer_step == 2 and loaded.in_layout, loaded
        assert state_diff == [] and moments > 0           # bit for bit with the in-memory reshard
        assert abs(lx - ly) < 1e-6 * abs(lx), (lx, ly)      # another layout: round-off only
        assert w_diff < 0.15 * LR, w_diff
        assert steps == {3.0}
