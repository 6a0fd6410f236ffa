"""megatron-core interop on CPU: name/layout mapping, GPTModel logits, dist_checkpointing both ways.

Real megatron-core 0.16.1 (GPTModel, parallel_state, dist_checkpointing) on real gloo worlds; the reference is our
single-process Transformer. Skipped when megatron-core is not installed (pip install -e '.[megatron]').
Logits agree to fp32 round-off (different attention kernels: Megatron's baddbmm + softmax vs SDPA); weights that
go through a checkpoint come back bit for bit.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tidal.engine.backends.megatron_ckpt import plan_chunks
from tidal.engine.backends.megatron_map import (QKVShape, check_megatron_tp, from_megatron, fuse_qkv,
                                                megatron_tp_shard, padded_vocab_size, split_qkv, to_megatron)
from tidal.engine.model import ModelArgs, init_global_weights, param_specs
from tidal.engine.testing import run_ranks
from tidal.errors import LayoutError

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                    "(pip install -e '.[megatron]')")

# vocab 51: uneven native vocab split at TP 2 (25 / 26); padded to 64 (divisible by 8 * tp for tp <= 8)
ARGS = dict(vocab_size=51, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
            max_seq_len=32)
VP = 64
TOL = 1e-5


def _args(**kw) -> ModelArgs:
    return ModelArgs(**{**ARGS, **kw})


def _ids() -> torch.Tensor:
    return torch.randint(0, ARGS["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))


def _local(w: dict, args: ModelArgs, tp: int, t: int) -> dict:
    return {s.name: w[s.name][s.tp_slices(tp, t)] for s in param_specs(args)}


# ---- pure mapping (no megatron-core needed) -------------------------------------------------------------------
def test_fused_qkv_layout_and_tp_shards():
    args = _args()
    qs = QKVShape.of(args)
    d, r = qs.head_dim, qs.rep
    q = torch.arange(args.num_heads * d, dtype=torch.float32)[:, None].expand(-1, 3).clone()
    k = -1 - torch.arange(args.num_kv_heads * d, dtype=torch.float32)[:, None].expand(-1, 3)
    v = 1000 + torch.arange(args.num_kv_heads * d, dtype=torch.float32)[:, None].expand(-1, 3)
    qkv = fuse_qkv(q, k, v, qs)
    # group g: its r query heads, then its key head, then its value head
    for g in range(qs.groups):
        block = qkv[g * qs.rows_per_group:(g + 1) * qs.rows_per_group, 0]
        assert torch.equal(block[:r * d], q[g * r * d:(g + 1) * r * d, 0])
        assert torch.equal(block[r * d:(r + 1) * d], k[g * d:(g + 1) * d, 0])
        assert torch.equal(block[(r + 1) * d:], v[g * d:(g + 1) * d, 0])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, qs), (q, k, v)))

    w = init_global_weights(args, 0)
    mg = to_megatron(w, args, VP)
    back = from_megatron(mg, args)
    assert set(back) == set(w) and all(torch.equal(back[n], w[n]) for n in w)
    for tp in (1, 2):
        for t in range(tp):  # fusing our TP shards gives exactly Megatron's TP shard of the fused tensor
            shard = megatron_tp_shard(mg, args, tp, t)
            loc = _local(w, args, tp, t)
            a = "layers.1.self_attn."
            fused = fuse_qkv(loc[a + "q_proj.weight"], loc[a + "k_proj.weight"], loc[a + "v_proj.weight"], qs)
            assert torch.equal(shard["decoder.layers.1.self_attention.linear_qkv.weight"], fused)
            assert torch.equal(shard["decoder.layers.1.mlp.linear_fc1.weight"],
                               torch.cat([loc["layers.1.mlp.gate_proj.weight"], loc["layers.1.mlp.up_proj.weight"]]))


def test_padded_vocab_and_tp_rules():
    assert padded_vocab_size(50257, 1) == 50304          # GPT-2 vocab in Megatron-LM
    assert padded_vocab_size(50257, 8) == 51200
    assert padded_vocab_size(51, 2, 8) == 64
    with pytest.raises(LayoutError, match="intermediate_size"):
        check_megatron_tp(_args(intermediate_size=90, num_heads=4, num_kv_heads=4), 4)
    with pytest.raises(LayoutError, match="num_kv_heads"):
        check_megatron_tp(_args(), 4)


@pytest.mark.parametrize("tp", [1, 2])
def test_checkpoint_chunks_cover_every_element_once(tp):
    """The chunks all TP ranks write tile each global tensor exactly (uneven vocab split, padding included)."""
    args = _args()
    cover: dict[str, torch.Tensor] = {}
    for t in range(tp):
        for c in plan_chunks(args, VP, tp, t):
            if c.tp_replicated and t > 0:
                continue  # replicas: t = 0 is the main one
            cnt = cover.setdefault(c.key, torch.zeros(c.global_shape, dtype=torch.int32))
            idx = [slice(o, o + 1) for o in c.offset[:1]] if c.layered else []
            rest = c.offset[1:] if c.layered else c.offset
            idx += [slice(o, o + n) for o, n in zip(rest, c.shape)]
            cnt[tuple(idx)] += 1
    assert len(cover) == 9
    for key, cnt in cover.items():
        assert bool((cnt == 1).all()), key


# ---- megatron-core on gloo -----------------------------------------------------------------------------------
def _reference(args: ModelArgs) -> tuple[dict, torch.Tensor]:
    """The test weights (seed 3) and our single-process Transformer's logits on `_ids()` with them."""
    from tidal.engine.model import Transformer

    w = init_global_weights(args, 3)
    ref = Transformer(args)
    ref.load_global(w)
    with torch.no_grad():
        return w, ref(_ids())


def _gpt_vs_transformer(rank, world):
    """GPTModel at TP = world with our weights (in-memory mapping) vs our single-process Transformer."""
    from tidal.engine.backends import megatron_cpu as mc

    args = _args()
    w, want = _reference(args)
    mc.init_parallel(world)
    m = mc.build_gpt(args, world, VP)
    mc.load_gpt_weights(m, megatron_tp_shard(to_megatron(w, args, VP), args, world, rank))
    got = mc.gpt_logits(m, _ids(), args.vocab_size)
    return float((got - want).abs().max())


@needs_megatron
def test_gpt_model_matches_our_transformer_tp1_tp2():
    assert max(run_ranks(1, _gpt_vs_transformer)) < TOL
    assert max(run_ranks(2, _gpt_vs_transformer)) < TOL


def _native_save(rank, world, path):
    from tidal.engine.backends.megatron_ckpt import save_megatron

    args = _args()
    save_megatron(path, args, _local(init_global_weights(args, 3), args, world, rank), world, rank, 0, VP)
    return sorted(os.listdir(path))


def _gpt_load(rank, world, path):
    """GPTModel's own sharded_state_dict + dist_checkpointing.load (as Megatron-LM loads), then logits; also the
    loaded weights against the exact mapping of the native ones."""
    from megatron.core import dist_checkpointing
    from tidal.engine.backends import megatron_cpu as mc

    args = _args()
    w, want = _reference(args)
    mc.init_parallel(world)
    m = mc.build_gpt(args, world, VP)
    with mc.cpu_shim():
        m.load_state_dict(dist_checkpointing.load(m.sharded_state_dict(), path))
    exact = megatron_tp_shard(to_megatron(w, args, VP), args, world, rank)
    own = m.state_dict()
    same = all(torch.equal(own[k], v) for k, v in exact.items())
    return float((mc.gpt_logits(m, _ids(), args.vocab_size) - want).abs().max()), same


@needs_megatron
@pytest.mark.slow  # about 50 s on 2 cores: three worlds, each importing megatron-core
def test_native_tp2_checkpoint_loads_into_gpt_model_tp1(tmp_path):
    path = str(tmp_path / "ckpt")
    files = run_ranks(2, _native_save, path, daemon=False)[0]
    assert {"metadata.json", ".metadata", "common.pt"} <= set(files)
    for diff, same in run_ranks(1, _gpt_load, path):
        assert same and diff < TOL
    for diff, same in run_ranks(2, _gpt_load, path):  # and at TP 2 (another split than ours for the vocab)
        assert same and diff < TOL


def _gpt_save(rank, world, path):
    """GPTModel at TP = world with megatron-core's own random init writes its checkpoint (as Megatron-LM does);
    returns its logits and its global weights in our names."""
    from megatron.core import dist_checkpointing
    from tidal.engine.backends import megatron_cpu as mc

    args = _args()
    mc.init_parallel(world)
    torch.manual_seed(7)
    m = mc.build_gpt(args, world, VP, init_method_std=0.05)
    with torch.no_grad():
        for name, p in m.named_parameters():  # norms away from 1 so a swapped norm would show
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    with mc.cpu_shim():
        dist_checkpointing.save(m.sharded_state_dict(), path)
    logits = mc.gpt_logits(m, _ids(), args.vocab_size)
    glob = {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
    return logits.numpy(), {k: v.numpy() for k, v in from_megatron(glob, args).items()} if world == 1 else None


def _native_load(rank, world, path, want_logits, want_weights):
    import torch.distributed as dist
    from tidal.engine.backends.megatron_ckpt import MegatronCheckpointError, load_megatron
    from tidal.engine.model import Transformer

    args = _args()
    local = load_megatron(path, args, world, rank)
    exact = all(torch.equal(local[s.name], torch.from_numpy(want_weights[s.name])[s.tp_slices(world, rank)])
                for s in param_specs(args))
    group = dist.new_group(list(range(world))) if world > 1 else None
    model = Transformer(args, group)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(local[name])
        logits = model.full_logits(model(_ids()))
    try:
        load_megatron(path, _args(intermediate_size=128), world, rank)
        error = ""
    except MegatronCheckpointError as e:
        error = str(e)
    return exact, float((logits - torch.from_numpy(want_logits)).abs().max()), error


@needs_megatron
@pytest.mark.slow  # about 45 s on 2 cores
def test_gpt_model_tp1_checkpoint_loads_into_native_tp2(tmp_path):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)  # megatron-core wants an existing (empty) directory
    logits, weights = run_ranks(1, _gpt_save, path, daemon=False)[0]
    for exact, diff, error in run_ranks(2, _native_load, path, logits, weights):
        assert exact and diff < TOL
        assert "linear_fc1.weight has shape (2, 192, 64) in the checkpoint, the model needs (2, 256, 64)" in error
        assert "intermediate_size=128" in error


# ---- backend protocol ----------------------------------------------------------------------------------------
def test_backend_registry_and_protocol():
    from tidal.engine.backends.native import NativeBackend
    from tidal.engine.backends.protocol import backend_names, make_backend, register_backend
    from tidal.errors import ConfigError

    assert "native" in backend_names()
    with pytest.raises(ValueError, match="already registered"):
        register_backend("native", NativeBackend)
    with pytest.raises(ConfigError, match="actor.backend.*use one of (megatron, )?native"):
        make_backend("nemo")


def _backend_roundtrip(rank, world, path):
    """Native backend at tp=2 trains one iter and writes Megatron format; a native backend at tp=1, dp=2 (other
    seed) loads it: its weights and fp32 masters equal the writer's bit for bit, moments and step are reset."""
    from tidal.engine.actor import SharedQueue, nll_loss
    from tidal.engine.backends.protocol import ActorBackend, make_backend
    from tidal.engine.layout import Layout
    from tidal.engine.optim import OptimConfig

    args, hp = _args(), OptimConfig(lr=1e-2)
    a = make_backend("native", args, hp, Layout(2, 1, (0, 1)), rank, seed=0)
    ids = torch.randint(0, args.vocab_size, (4, 2, 9), generator=torch.Generator().manual_seed(2))
    a.train_iter(SharedQueue(list(ids)), nll_loss, ids[:, :, 1:].numel())
    a.save_megatron(path, padded_vocab=VP)
    b = make_backend("native", args, hp, Layout(1, 2, (0, 1)), rank, seed=5)
    b.load_megatron(path)
    assert isinstance(b, ActorBackend) and b.layout == Layout(1, 2, (0, 1))
    assert b.inventory() == tuple(param_specs(args))
    ga, gb = a.shard.state_dict_global(), b.shard.state_dict_global()
    names = [s.name for s in param_specs(args)]
    params = all(torch.equal(ga[f"param/{n}"], gb[f"param/{n}"]) for n in names)
    masters = all(torch.equal(gb[f"master/{n}"], ga[f"param/{n}"]) for n in names)
    reset = all(not gb[f"exp_avg/{n}"].any() for n in names) and int(gb["step"]) == 0 and int(ga["step"]) == 1
    trained = not torch.equal(ga["param/layers.0.mlp.up_proj.weight"], init_global_weights(args, 0)[
        "layers.0.mlp.up_proj.weight"])
    return params, masters, reset, trained


@needs_megatron
@pytest.mark.slow  # about 25-35 s on 2 cores
def test_native_backend_megatron_checkpoint_changes_layout(tmp_path):
    for params, masters, reset, trained in run_ranks(2, _backend_roundtrip, str(tmp_path / "ckpt"), daemon=False):
        assert params and masters and reset and trained


# ---- Megatron-layout weights through Tidal's reshard planner (no megatron-core needed) ------------------------
def _megatron_reshard(rank, world):
    from tidal.engine.backends.megatron_reshard import reshard_megatron_weights
    from tidal.engine.layout import Layout

    args = _args()
    mg = to_megatron(init_global_weights(args, 3), args, VP)
    a, b, c = Layout(1, 2, (0, 1)), Layout(2, 1, (0, 1)), Layout(1, 1, (1,))

    def want(lay):
        co = lay.coord(rank)
        return None if co is None else megatron_tp_shard(mg, args, lay.tp, co[0])

    def same(x, y):
        return (x is None and y is None) or (set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x))

    s_b, plan = reshard_megatron_weights(want(a), args, VP, a, b, rank)
    s_a, _ = reshard_megatron_weights(s_b, args, VP, b, a, rank)
    s_c, _ = reshard_megatron_weights(s_b, args, VP, b, c, rank)
    s_b2, _ = reshard_megatron_weights(s_c, args, VP, c, b, rank)
    moved = sum(m.numel for m in plan.moves if m.what == "param" and m.src != m.dst)
    return same(s_b, want(b)), same(s_a, want(a)), same(s_c, want(c)), same(s_b2, want(b)), moved


def test_megatron_weights_reshard_with_our_planner():
    """GPTModel TP-local weights (fused QKV, [gate_t; up_t], padded vocab) move tp1 x dp2 -> tp2 -> back, and
    tp2 -> one rank -> tp2, bit for bit equal to Megatron's own TP shards of the same global weights."""
    results = run_ranks(2, _megatron_reshard)
    for ok_b, ok_a, ok_c, ok_b2, moved in results:
        assert ok_b and ok_a and ok_c and ok_b2
    assert results[0][4] == 0  # tp1 x dp2 -> tp2 on the same devices: every rank already holds its new shard
