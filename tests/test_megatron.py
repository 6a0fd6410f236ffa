"""megatron-core interop on CPU: name/layout mapping, GPTModel logits, dist_checkpointing both ways.

Real megatron-core 0.16.1 (GPTModel, parallel_state, dist_checkpointing) on real gloo worlds; the reference is our
single-process Transformer. Skipped when megatron-core is not installed (pip install -e '.[megatron]').
Logits agree to fp32 round-off (different attention kernels: Megatron's baddbmm + softmax vs SDPA); weights that
go through a checkpoint come back bit for bit. Every conversion runs for the model families of `CASES` (Llama,
Qwen2-style q/k/v biases, Qwen3-style q/k norms with an explicit head_dim), with random nonzero biases and norm
weights so that a dropped or misplaced tensor shows; the logit comparison adds RoPE scaling (llama3, linear).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tidal.core.errors import LayoutError
from tidal.engine.backends.megatron_ckpt import plan_chunks
from tidal.engine.backends.megatron_map import (
    QKVShape,
    check_megatron_tp,
    from_megatron,
    fuse_qkv,
    megatron_tp_shard,
    padded_vocab_size,
    split_qkv,
    to_megatron,
)
from tidal.engine.model import ModelArgs, RopeScaling, init_global_weights, param_specs
from tidal.engine.testing import run_ranks

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                    "(pip install -e '.[megatron]')")

# vocab 51: uneven native vocab split at TP 2 (25 / 26); padded to 64 (divisible by 8 * tp for tp <= 8)
ARGS = dict(vocab_size=51, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
            max_seq_len=32)
VP = 64
TOL = 1e-5
QKV_BIAS_KEY = "decoder.layers.1.self_attention.linear_qkv.bias"
QNORM_KEY = "decoder.layers.1.self_attention.q_layernorm.weight"
#: model families: Llama; Qwen2 (q/k/v biases); Qwen3 (q/k norms, head_dim 24 != hidden / heads = 16)
CASES = {"llama": {}, "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True, head_dim=24)}
#: RoPE scaling megatron-core expresses (compared on logits only: no tensors of their own)
ROPE_CASES = {"llama3_rope": dict(rope_scaling=RopeScaling("llama3", factor=8.0)),
              "linear_rope": dict(rope_scaling=RopeScaling("linear", factor=2.0))}


def _args(**kw) -> ModelArgs:
    return ModelArgs(**{**ARGS, **kw})


def _weights(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """`init_global_weights` with random nonzero q/k/v biases and q/k norm weights (init gives 0 and 1)."""
    w = init_global_weights(args, seed)
    g = torch.Generator().manual_seed(seed + 100)
    for name, t in w.items():
        if name.endswith("_proj.bias"):
            w[name] = torch.randn(t.shape, generator=g) * 0.3
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            w[name] = 0.5 + torch.rand(t.shape, generator=g)
    return w


def _ids() -> torch.Tensor:
    return torch.randint(0, ARGS["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))


def _local(w: dict, args: ModelArgs, tp: int, t: int) -> dict:
    return {s.name: w[s.name][s.tp_slices(tp, t)] for s in param_specs(args)}


# ---- pure mapping (no megatron-core needed) -------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_qkv_layout_and_tp_shards(case):
    args = _args(**CASES[case])
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

    w = _weights(args, 0)
    mg = to_megatron(w, args, VP)
    assert (QKV_BIAS_KEY in mg) == args.qkv_bias and (QNORM_KEY in mg) == args.qk_norm
    back = from_megatron(mg, args)
    assert set(back) == set(w) and all(torch.equal(back[n], w[n]) for n in w)
    for tp in (1, 2):
        for t in range(tp):  # fusing our TP shards gives exactly Megatron's TP shard of the fused tensor
            shard = megatron_tp_shard(mg, args, tp, t)
            loc = _local(w, args, tp, t)
            a = "layers.1.self_attn."
            fused = fuse_qkv(loc[a + "q_proj.weight"], loc[a + "k_proj.weight"], loc[a + "v_proj.weight"], qs)
            assert torch.equal(shard["decoder.layers.1.self_attention.linear_qkv.weight"], fused)
            if args.qkv_bias:  # the bias rows are fused and split exactly like the weight's
                fused_b = fuse_qkv(loc[a + "q_proj.bias"], loc[a + "k_proj.bias"], loc[a + "v_proj.bias"], qs)
                assert torch.equal(shard[QKV_BIAS_KEY], fused_b)
                assert torch.equal(split_qkv(mg[QKV_BIAS_KEY], qs)[1], w[a + "k_proj.bias"])
            if args.qk_norm:  # replicated
                assert torch.equal(shard[QNORM_KEY], w[a + "q_norm.weight"])
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


def test_rope_scaling_megatron_cannot_express_is_an_error():
    """megatron-core 0.16.1's llama3 scaling takes only the factor; other fixed values raise, naming the field
    (mapping, checkpoint plan and GPTModel arguments alike), never a silently different RoPE."""
    from tidal.engine.backends.megatron_map import gpt_model_kwargs

    ok = _args(rope_scaling=RopeScaling("llama3", factor=32.0))  # Llama 3.2's values
    assert gpt_model_kwargs(ok, VP)["rope_scaling_factor"] == 32.0 and gpt_model_kwargs(ok, VP)["rope_scaling"]
    assert gpt_model_kwargs(_args(rope_scaling=RopeScaling("linear", factor=4.0)), VP)[
        "seq_len_interpolation_factor"] == 4.0
    for field, value in (("low_freq_factor", 2.0), ("high_freq_factor", 8.0),
                         ("original_max_position_embeddings", 4096)):
        bad = _args(rope_scaling=RopeScaling("llama3", factor=8.0, **{field: value}))
        for fn in (lambda bad=bad: gpt_model_kwargs(bad, VP), lambda bad=bad: plan_chunks(bad, VP, 1, 0)):
            with pytest.raises(LayoutError, match=f"model.rope_scaling.{field}.*only the factor"):
                fn()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_checkpoint_chunks_cover_every_element_once(tp, case):
    """The chunks all TP ranks write tile each global tensor exactly (uneven vocab split, padding included)."""
    args = _args(**CASES[case])
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
    assert len(cover) == 9 + args.qkv_bias + 2 * args.qk_norm
    for key, cnt in cover.items():
        assert bool((cnt == 1).all()), key


# ---- megatron-core on gloo -----------------------------------------------------------------------------------
def _reference(args: ModelArgs) -> tuple[dict, torch.Tensor]:
    """The test weights (seed 3) and our single-process Transformer's logits on `_ids()` with them."""
    from tidal.engine.model import Transformer

    w = _weights(args, 3)
    ref = Transformer(args)
    ref.load_global(w)
    with torch.no_grad():
        return w, ref(_ids())


def _rope_angles(args: ModelArgs) -> torch.Tensor:
    """Our RoPE angles [max_seq_len, D] (position x inverse frequency, rotate-half layout), fp64."""
    from tidal.engine.model import rope_inv_freq

    freqs = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), rope_inv_freq(args))
    return torch.cat([freqs, freqs], dim=-1)


def _gpt_vs_transformer(rank, world):
    """GPTModel at TP = world with our weights (in-memory mapping) vs our single-process Transformer, per case:
    (max logit diff, the effect of the case's feature, max RoPE angle diff). The effect is what dropping the
    feature would change: our logits without the bias / norms, or (RoPE scaling: its effect on logits of short
    sequences is ~1e-5) our RoPE angles without the scaling."""
    from tidal.engine.backends import megatron_cpu as mc

    mc.init_parallel(world)
    out = {}
    for case, kw in {**CASES, **ROPE_CASES}.items():
        args = _args(**kw)
        w, want = _reference(args)
        m = mc.build_gpt(args, world, VP)
        mc.load_gpt_weights(m, megatron_tp_shard(to_megatron(w, args, VP), args, world, rank))
        got = mc.gpt_logits(m, _ids(), args.vocab_size)
        with mc.cpu_shim():  # Megatron's angles: its inv_freq (llama3 scaling) x positions / interpolation factor
            angles = m.rotary_pos_emb(args.max_seq_len)[:, 0, 0, :].double()
        ours = _rope_angles(args)
        plain = _args(head_dim=kw.get("head_dim", 0))
        if case in ROPE_CASES:
            effect = float((_rope_angles(plain) - ours).abs().max())
        else:
            effect = float((_reference(plain)[1] - want).abs().max()) if kw else 0.0
        out[case] = (float((got - want).abs().max()), effect, float((angles - ours).abs().max()))
    return out


@needs_megatron
def test_gpt_model_matches_our_transformer_tp1_tp2():
    for world in (1, 2):
        for out in run_ranks(world, _gpt_vs_transformer):
            assert set(out) == set(CASES) | set(ROPE_CASES)
            for case, (diff, effect, rope_diff) in out.items():
                assert diff < TOL and rope_diff < TOL, (world, case, diff, rope_diff)
                assert case == "llama" or effect > 1e-2, (case, effect)  # the feature matters: a drop would show


def _native_save(rank, world, path):
    from tidal.engine.backends.megatron_ckpt import save_megatron

    files = {}
    for case, kw in CASES.items():
        args = _args(**kw)
        save_megatron(f"{path}/{case}", args, _local(_weights(args, 3), args, world, rank), world, rank, 0, VP)
        files[case] = sorted(os.listdir(f"{path}/{case}"))
    return files


def _gpt_load(rank, world, path):
    """GPTModel's own sharded_state_dict + dist_checkpointing.load (as Megatron-LM loads; default strictness, so
    a tensor we did not write fails), then logits; also the loaded weights against the exact mapping of the
    native ones. Per case."""
    from megatron.core import dist_checkpointing

    from tidal.engine.backends import megatron_cpu as mc

    mc.init_parallel(world)
    out = {}
    for case, kw in CASES.items():
        args = _args(**kw)
        w, want = _reference(args)
        m = mc.build_gpt(args, world, VP)
        with mc.cpu_shim():
            m.load_state_dict(dist_checkpointing.load(m.sharded_state_dict(), f"{path}/{case}"))
        exact = megatron_tp_shard(to_megatron(w, args, VP), args, world, rank)
        own = m.state_dict()
        same = set(exact) == {k for k, v in own.items() if isinstance(v, torch.Tensor)} and all(
            torch.equal(own[k], v) for k, v in exact.items())
        out[case] = float((mc.gpt_logits(m, _ids(), args.vocab_size) - want).abs().max()), same
    return out


@needs_megatron
@pytest.mark.slow  # about 50 s on 2 cores: three worlds, each importing megatron-core
def test_native_tp2_checkpoint_loads_into_gpt_model_tp1(tmp_path):
    path = str(tmp_path / "ckpt")
    files = run_ranks(2, _native_save, path, daemon=False)[0]
    assert all({"metadata.json", ".metadata", "common.pt"} <= set(f) for f in files.values())
    for world in (1, 2):  # and at TP 2 (another split than ours for the vocab)
        for out in run_ranks(world, _gpt_load, path):
            assert set(out) == set(CASES)
            for case, (diff, same) in out.items():
                assert same and diff < TOL, (world, case, diff, same)


def _gpt_save(rank, world, path):
    """GPTModel at TP = world with megatron-core's own random init writes its checkpoint (as Megatron-LM does),
    per case; returns its logits and its global weights in our names."""
    from megatron.core import dist_checkpointing

    from tidal.engine.backends import megatron_cpu as mc

    mc.init_parallel(world)
    out = {}
    for case, kw in CASES.items():
        args = _args(**kw)
        torch.manual_seed(7)
        m = mc.build_gpt(args, world, VP, init_method_std=0.05)
        with torch.no_grad():
            for name, p in m.named_parameters():  # norms away from 1, biases away from 0: a swap or drop shows
                if "layernorm" in name:
                    p.uniform_(0.5, 1.5)
                elif name.endswith("linear_qkv.bias"):
                    p.uniform_(-0.5, 0.5)
        os.makedirs(f"{path}/{case}")  # megatron-core wants an existing (empty) directory
        with mc.cpu_shim():
            dist_checkpointing.save(m.sharded_state_dict(), f"{path}/{case}")
        logits = mc.gpt_logits(m, _ids(), args.vocab_size)
        glob = {k: v.clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
        out[case] = logits.numpy(), {k: v.numpy() for k, v in from_megatron(glob, args).items()}
    return out


def _load_error(path, args, world, rank) -> str:
    from tidal.engine.backends.megatron_ckpt import MegatronCheckpointError, load_megatron
    try:
        load_megatron(path, args, world, rank)
    except MegatronCheckpointError as e:
        return str(e)
    return ""


def _native_load(rank, world, path, saved):
    import torch.distributed as dist

    from tidal.engine.backends.megatron_ckpt import load_megatron
    from tidal.engine.model import Transformer

    group = dist.new_group(list(range(world))) if world > 1 else None
    out = {}
    for case, kw in CASES.items():
        args = _args(**kw)
        want_logits, want_weights = saved[case]
        local = load_megatron(f"{path}/{case}", args, world, rank)
        exact = set(local) == set(want_weights) and all(
            torch.equal(local[s.name], torch.from_numpy(want_weights[s.name])[s.tp_slices(world, rank)])
            for s in param_specs(args))
        model = Transformer(args, group)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(local[name])
            logits = model.full_logits(model(_ids()))
        out[case] = exact, float((logits - torch.from_numpy(want_logits)).abs().max())
    errors = {"ffn": _load_error(f"{path}/llama", _args(intermediate_size=128), world, rank),
              # a checkpoint tensor the model has no parameter for, or the reverse: an error, never a drop
              "bias_dropped": _load_error(f"{path}/qwen2", _args(), world, rank),
              "bias_missing": _load_error(f"{path}/llama", _args(qkv_bias=True), world, rank),
              "norm_dropped": _load_error(f"{path}/qwen3", _args(head_dim=24), world, rank),
              "head_dim": _load_error(f"{path}/qwen3", _args(qk_norm=True), world, rank)}
    return out, errors


@needs_megatron
@pytest.mark.slow  # about 45 s on 2 cores
def test_gpt_model_tp1_checkpoint_loads_into_native_tp2(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(1, _gpt_save, path, daemon=False)[0]
    for out, errors in run_ranks(2, _native_load, path, saved):
        assert set(out) == set(CASES)
        for case, (exact, diff) in out.items():
            assert exact and diff < TOL, (case, exact, diff)
        e = errors
        assert "linear_fc1.weight has shape (2, 192, 64) in the checkpoint, the model needs (2, 256, 64)" in e["ffn"]
        assert "intermediate_size=128" in e["ffn"]
        assert e["bias_dropped"].startswith("model.qkv_bias: ") and "set model.qkv_bias=true" in e["bias_dropped"]
        assert "linear_qkv.bias" in e["bias_dropped"]
        assert e["bias_missing"].startswith("model.qkv_bias: ") and "set model.qkv_bias=false" in e["bias_missing"]
        assert e["norm_dropped"].startswith("model.qk_norm: ") and "k_layernorm.weight" in e["norm_dropped"]
        assert "linear_qkv.weight has shape (2, 192, 64)" in e["head_dim"] and "head_dim=16" in e["head_dim"]


# ---- backend protocol ----------------------------------------------------------------------------------------
def test_backend_registry_and_protocol():
    from tidal.core.errors import ConfigError
    from tidal.engine.backends.native import NativeBackend
    from tidal.engine.backends.protocol import backend_names, make_backend, register_backend

    assert "native" in backend_names()
    with pytest.raises(ValueError, match="already registered"):
        register_backend("native", NativeBackend)
    with pytest.raises(ConfigError, match="actor.backend.*use one of (megatron, )?native"):
        make_backend("nemo")


def _backend_roundtrip(rank, world, path):
    """Native backend at tp=2 trains one iter and writes Megatron format; a native backend at tp=1, dp=2 (other
    seed) loads it: its weights and fp32 masters equal the writer's bit for bit, moments and step are reset.
    Per case: the trained biases and q/k norms (TP-split / TP-replicated) must come back too."""
    from tidal.engine.actor import SharedQueue, nll_loss
    from tidal.engine.backends.protocol import ActorBackend, make_backend
    from tidal.engine.layout import Layout
    from tidal.engine.optim import OptimConfig

    out = {}
    for case, kw in CASES.items():
        args, hp = _args(**kw), OptimConfig(lr=1e-2)
        a = make_backend("native", args, hp, Layout(2, 1, (0, 1)), rank, seed=0)
        ids = torch.randint(0, args.vocab_size, (4, 2, 9), generator=torch.Generator().manual_seed(2))
        a.train_iter(SharedQueue(list(ids)), nll_loss, ids[:, :, 1:].numel())
        a.save_megatron(f"{path}/{case}", padded_vocab=VP)
        b = make_backend("native", args, hp, Layout(1, 2, (0, 1)), rank, seed=5)
        b.load_megatron(f"{path}/{case}")
        assert isinstance(b, ActorBackend) and b.layout == Layout(1, 2, (0, 1))
        assert b.inventory() == tuple(param_specs(args))
        ga, gb = a.shard.state_dict_global(), b.shard.state_dict_global()
        names = [s.name for s in param_specs(args)]
        params = all(torch.equal(ga[f"param/{n}"], gb[f"param/{n}"]) for n in names)
        masters = all(torch.equal(gb[f"master/{n}"], ga[f"param/{n}"]) for n in names)
        reset = all(not gb[f"exp_avg/{n}"].any() for n in names) and int(gb["step"]) == 0 and int(ga["step"]) == 1
        init = init_global_weights(args, 0)  # biases start at 0, norms at 1: trained ones moved away
        trained = [n for n in ("layers.0.mlp.up_proj.weight", "layers.1.self_attn.k_proj.bias",
                               "layers.1.self_attn.q_norm.weight") if n in init]
        trained = all(not torch.equal(ga[f"param/{n}"], init[n]) for n in trained)
        out[case] = params, masters, reset, trained
    return out


@needs_megatron
@pytest.mark.slow  # about 25-35 s on 2 cores
def test_native_backend_megatron_checkpoint_changes_layout(tmp_path):
    for out in run_ranks(2, _backend_roundtrip, str(tmp_path / "ckpt"), daemon=False):
        assert set(out) == set(CASES)
        for case, (params, masters, reset, trained) in out.items():
            assert params and masters and reset and trained, case


# ---- Megatron-layout weights through Tidal's reshard planner (no megatron-core needed) ------------------------
def _megatron_reshard(rank, world):
    from tidal.engine.backends.megatron_reshard import megatron_specs, reshard_megatron_weights
    from tidal.engine.layout import Layout

    out = []
    for kw in CASES.values():
        args = _args(**kw)
        mg = to_megatron(_weights(args, 3), args, VP)
        assert {s.name.partition("#")[0] for s in megatron_specs(args, VP)} == set(mg)  # every tensor is moved
        a, b, c = Layout(1, 2, (0, 1)), Layout(2, 1, (0, 1)), Layout(1, 1, (1,))

        def want(lay, mg=mg, args=args):
            co = lay.coord(rank)
            return None if co is None else megatron_tp_shard(mg, args, lay.tp, co[0])

        def same(x, y):
            return (x is None and y is None) or (set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x))

        s_b, plan = reshard_megatron_weights(want(a), args, VP, a, b, rank)
        s_a, _ = reshard_megatron_weights(s_b, args, VP, b, a, rank)
        s_c, _ = reshard_megatron_weights(s_b, args, VP, b, c, rank)
        s_b2, _ = reshard_megatron_weights(s_c, args, VP, c, b, rank)
        moved = sum(m.numel for m in plan.moves if m.what == "param" and m.src != m.dst)
        out.append((same(s_b, want(b)), same(s_a, want(a)), same(s_c, want(c)), same(s_b2, want(b)), moved))
    return out


def test_megatron_weights_reshard_with_our_planner():
    """GPTModel TP-local weights (fused QKV and its bias, q/k norms, [gate_t; up_t], padded vocab) move tp1 x dp2
    -> tp2 -> back, and tp2 -> one rank -> tp2, bit for bit equal to Megatron's own TP shards of the same global
    weights (every case)."""
    results = [r for rank_out in run_ranks(2, _megatron_reshard) for r in rank_out]
    assert len(results) == 2 * len(CASES)
    for ok_b, ok_a, ok_c, ok_b2, _moved in results:
        assert ok_b and ok_a and ok_c and ok_b2
    # tp1 x dp2 -> tp2 on the same devices: every rank already holds its new shard
    assert all(r[4] == 0 for r in results)
