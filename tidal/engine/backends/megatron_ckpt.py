"""Write and read megatron-core `dist_checkpointing` checkpoints (torch_dist format) from native weights.

A Megatron checkpoint stores each *global* tensor under its key (names and fused layouts: megatron_map.py) as
chunks; a loader asks for any region of any key and PyTorch DCP reads the overlapping chunks. So neither side
needs the other's layout: we write the TP shards we hold and read the regions we want, and megatron-core does
the same with its own TP split (GPTModel at any TP loads what we wrote at any TP, and the reverse).

What one native rank (t, d) of a layout (tp, dp) writes (only DP replica 0 is the "main replica"; megatron-core
writes main replicas only, so every element is stored once)::

    our TP-local tensor                     checkpoint key (layers stacked on axis 0)   chunk (global offset)
    embed_tokens / lm_head rows [lo, hi)    embedding.word_embeddings / output_layer      rows [lo, hi); the last
                                                                                          TP rank adds [V, Vp) = 0
    q_t, k_t, v_t (kv groups [g0, g1))      decoder.layers.self_attention.linear_qkv      (i, g0 * (r+2) D, 0)
    q/k/v biases (qkv_bias, same groups)    ...self_attention.linear_qkv.bias             (i, g0 * (r+2) D)
    q/k norms (qk_norm; t = 0 writes)       ...self_attention.{q,k}_layernorm.weight      (i, 0)
    gate_t / up_t (rows [lo, hi) of F)      decoder.layers.mlp.linear_fc1                 (i, lo, 0) / (i, F + lo, 0)
    o_proj / down_proj (cols [lo, hi))      ...linear_proj / ...linear_fc2                (i, 0, lo)
    norms (replicated over TP: t = 0 writes) ...layer_norm_weight / final_layernorm       (i, 0) / (0,)

Our floor splits need not be Megatron's even ones (vocab, SwiGLU width), so chunks are declared without a regular
grid (`axis_fragmentations=None`), which megatron-core accepts and hands to DCP. Reading plans the same chunks
with empty tensors and un-fuses them; padded vocab rows are read by the last TP rank and dropped. The layers'
`_extra_state` objects GPTModel's linears carry (None without Transformer Engine) are written as megatron-core
writes them, so `GPTModel.sharded_state_dict()` loads our checkpoint with the default strictness.

Both `save_megatron` and `load_megatron` are collective over the torch.distributed world (dist_checkpointing
all-gathers plans); the saver must be allowed to fork (megatron_cpu.py). These two move weights (what a native
actor holds in Megatron's terms); the Megatron actor writes its distributed-optimizer state with them
(megatron_state_ckpt.py), and `load_megatron` here reads the weights of such a checkpoint and ignores the
`optimizer.state.*` keys.

    exported = shard.export_weights()                      # ActorShard at tp=2, dp=1
    save_megatron("ckpt/iter_0000004", args, exported.tensors, tp=2, t=exported.t, d=0)
    local = load_megatron("ckpt/iter_0000004", args, tp=1, t=0)   # our names, TP shard of tp=1 (global)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.core.errors import TidalError
from tidal.engine.backends.megatron_cpu import cpu_shim, import_megatron
from tidal.engine.backends.megatron_map import (
    EXTRA_STATE_LINEARS,
    FC1,
    QK_NORMS,
    QKV,
    QKV_BIAS,
    QKVShape,
    check_megatron_args,
    fuse_qkv,
    padded_vocab_size,
    split_qkv,
)
from tidal.engine.layout import split
from tidal.engine.model import ModelArgs, check_tp

EMB, OUT, FINAL_NORM = "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"
_NORM_KEYS = {"input_layernorm.weight": "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
              "post_attention_layernorm.weight": "decoder.layers.mlp.linear_fc1.layer_norm_weight"}


#: checkpoint key (after `decoder.layers.`) of a model switch -> (the switch, what the tensor is)
_SWITCH = {QKV_BIAS: ("model.qkv_bias", "q/k/v biases"),
           **dict.fromkeys(QK_NORMS.values(), ("model.qk_norm", "q/k norms"))}
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


class MegatronCheckpointError(TidalError):
    """A Megatron checkpoint that does not fit the model: names the key or field and the fix."""


@dataclass(frozen=True)
class Chunk:
    """One region of one checkpoint key that a rank writes or reads.

    `name` is unique within a rank's plan: our parameter name, or `layers.<i>.self_attn.qkv` (and `.qkv_bias`)
    for the fused attention block. `offset` is the global offset including the stacked-layer axis when `layered`."""

    name: str
    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    layered: bool
    tp_replicated: bool


def plan_chunks(args: ModelArgs, padded_vocab: int, tp: int, t: int) -> list[Chunk]:
    """The chunks native TP rank t of tp holds (pure; the same plan serves writing and reading)."""
    check_tp(args, tp)
    check_megatron_args(args)
    if padded_vocab < args.vocab_size:
        raise MegatronCheckpointError("padded_vocab", padded_vocab, f"is smaller than model.vocab_size="
                                      f"{args.vocab_size}", "use padded_vocab_size(vocab_size, tp)")
    h, L, f, qs = args.hidden_size, args.num_layers, args.intermediate_size, QKVShape.of(args)
    hd = args.num_heads * args.head_dim
    out: list[Chunk] = []

    def vocab(name: str, key: str) -> None:
        lo, hi = split(args.vocab_size, tp, t)
        hi = padded_vocab if t == tp - 1 else hi  # the last rank carries the padding rows
        out.append(Chunk(name, key, (padded_vocab, h), (lo, 0), (hi - lo, h), False, False))

    vocab("embed_tokens.weight", EMB)
    g0, g1 = split(args.num_kv_heads, tp, t)
    f0, f1 = split(f, tp, t)
    c0, c1 = split(hd, tp, t)
    for i in range(L):
        p = f"layers.{i}."
        for ours, key in _NORM_KEYS.items():
            out.append(Chunk(p + ours, key, (L, h), (i, 0), (h,), True, True))
        rows = qs.groups * qs.rows_per_group
        out.append(Chunk(p + "self_attn.qkv", "decoder.layers." + QKV, (L, rows, h),
                         (i, g0 * qs.rows_per_group, 0), ((g1 - g0) * qs.rows_per_group, h), True, False))
        if args.qkv_bias:
            out.append(Chunk(p + "self_attn.qkv_bias", "decoder.layers." + QKV_BIAS, (L, rows),
                             (i, g0 * qs.rows_per_group), ((g1 - g0) * qs.rows_per_group,), True, False))
        if args.qk_norm:
            for ours, key in QK_NORMS.items():
                out.append(Chunk(p + "self_attn." + ours, "decoder.layers." + key, (L, qs.head_dim), (i, 0),
                                 (qs.head_dim,), True, True))
        out.append(Chunk(p + "self_attn.o_proj.weight", "decoder.layers.self_attention.linear_proj.weight",
                         (L, h, hd), (i, 0, c0), (h, c1 - c0), True, False))
        fc1 = "decoder.layers." + FC1
        out.append(Chunk(p + "mlp.gate_proj.weight", fc1, (L, 2 * f, h), (i, f0, 0), (f1 - f0, h), True, False))
        out.append(Chunk(p + "mlp.up_proj.weight", fc1, (L, 2 * f, h), (i, f + f0, 0), (f1 - f0, h), True, False))
        out.append(Chunk(p + "mlp.down_proj.weight", "decoder.layers.mlp.linear_fc2.weight", (L, h, f),
                         (i, 0, f0), (h, f1 - f0), True, False))
    out.append(Chunk("norm.weight", FINAL_NORM, (h,), (0,), (h,), False, True))
    if not args.tie_embeddings:
        vocab("lm_head.weight", OUT)
    return out


def pack(local: dict[str, torch.Tensor], args: ModelArgs, chunks: list[Chunk]) -> dict[str, torch.Tensor]:
    """Chunk tensors from TP-local weights (our names): fuse q/k/v, zero-pad the last vocab shard."""
    qs, out = QKVShape.of(args), {}
    for c in chunks:
        if c.name.endswith(".self_attn.qkv"):
            a = c.name.removesuffix("qkv")
            w = fuse_qkv(local[a + "q_proj.weight"], local[a + "k_proj.weight"], local[a + "v_proj.weight"], qs)
        elif c.name.endswith(".self_attn.qkv_bias"):
            a = c.name.removesuffix("qkv_bias")
            w = fuse_qkv(local[a + "q_proj.bias"], local[a + "k_proj.bias"], local[a + "v_proj.bias"], qs)
        elif c.key in (EMB, OUT):
            w = local[c.name]
            w = torch.cat([w, w.new_zeros(c.shape[0] - w.shape[0], w.shape[1])]) if c.shape[0] > w.shape[0] else w
        else:
            w = local[c.name]
        assert tuple(w.shape) == c.shape, (c, tuple(w.shape))
        out[c.name] = w.contiguous()
    return out


def unpack(data: dict[str, torch.Tensor], args: ModelArgs, tp: int, t: int) -> dict[str, torch.Tensor]:
    """TP-local weights (our names) from chunk tensors: split q/k/v, drop padding rows."""
    qs, out = QKVShape.of(args), {}
    lo, hi = split(args.vocab_size, tp, t)
    for name, w in data.items():
        if name.endswith(".self_attn.qkv"):
            a = name.removesuffix("qkv")
            out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = split_qkv(w, qs)
        elif name.endswith(".self_attn.qkv_bias"):
            a = name.removesuffix("qkv_bias")
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = split_qkv(w, qs)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = w[:hi - lo].contiguous()
        else:
            out[name] = w
    return out


def _sharded(chunks: list[Chunk], tensors: dict[str, torch.Tensor], args: ModelArgs, t: int, d: int,
             extra_state: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    sd: dict = {}
    for c in chunks:
        w = tensors[c.name]
        # The layer axis is a real size-1 axis, not megatron-core's `prepend_axis_num`: its irregular-grid path
        # (CheckpointableShardedTensor) ignores prepended axes; the stored chunks are the same either way.
        shape = (1, *c.shape) if c.layered else c.shape
        # replica (pipeline, tensor, data): (0, 0, 0) is the main replica, the one that is written
        sd[c.name] = ShardedTensor(c.key, w.reshape(shape), w.dtype, shape, c.global_shape, c.offset, None,
                                   replica_id=(0, t if c.tp_replicated else 0, d))
    if extra_state:
        for i in range(args.num_layers):
            for lin in EXTRA_STATE_LINEARS:
                key = f"decoder.layers.{lin}._extra_state"
                sd[f"layers.{i}.{lin}._extra_state"] = ShardedObject(key, None, (args.num_layers,), (i,),
                                                                     replica_id=(0, t, d))
    return sd


def save_megatron(ckpt_dir: str | Path, args: ModelArgs, local: dict[str, torch.Tensor] | None, tp: int, t: int,
                  d: int, padded_vocab: int | None = None) -> Path:
    """Write a dist_checkpointing checkpoint from native TP shard t of tp (`local`, our names, e.g.
    `ActorShard.export_weights().tensors`; a global state dict is tp=1, t=0). Collective over the world: every
    rank calls; ranks that hold no weights pass `local=None`. `ckpt_dir` must be new or empty. `padded_vocab`:
    the padded vocab of the Megatron run that will read it (default: Megatron-LM's rule at this tp, 128)."""
    import_megatron()
    from megatron.core import dist_checkpointing

    vp = padded_vocab or padded_vocab_size(args.vocab_size, tp)
    path = Path(ckpt_dir)
    ok = torch.ones(1, dtype=torch.int32)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        ok[0] = int(not any(path.iterdir()))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank raises, none waits in the save
    if not ok.item():
        raise MegatronCheckpointError("checkpoint", str(path), "is not empty",
                                      "write each checkpoint into a new directory")
    sd: dict = {}
    if local is not None:
        chunks = plan_chunks(args, vp, tp, t)
        sd = _sharded(chunks, pack({k: v.detach().cpu() for k, v in local.items()}, args, chunks), args, t, d,
                      extra_state=True)
    with cpu_shim():
        dist_checkpointing.save(sd, str(path))
    return path


def check_checkpoint(ckpt_dir: str | Path, args: ModelArgs) -> tuple[int, torch.dtype]:
    """The checkpoint's padded vocab and dtype, after checking every key we read against the model (the error
    names the key, the checkpoint's shape, the model field that disagrees)."""
    import_megatron()
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    if EMB not in meta:
        raise MegatronCheckpointError("checkpoint", str(ckpt_dir), f"has no {EMB} (not a GPT checkpoint?)",
                                      "pass a megatron-core GPTModel dist_checkpointing directory")
    vp = meta[EMB].global_shape[0]
    want = {c.key: c.global_shape for c in plan_chunks(args, max(vp, args.vocab_size), 1, 0)}
    for key, shape in want.items():
        if key not in meta:
            switch = _SWITCH.get(key.removeprefix("decoder.layers."))
            if switch is not None:
                raise MegatronCheckpointError(switch[0], True, f"{ckpt_dir} has no {switch[1]} ({key})",
                                              f"set {switch[0]}=false")
            fix = "set model.tie_embeddings=true" if key == OUT else "use a checkpoint of this architecture"
            raise MegatronCheckpointError("checkpoint", str(ckpt_dir), f"has no tensor {key}", fix)
        got = tuple(meta[key].global_shape)
        if got != shape:
            raise MegatronCheckpointError(
                "model", str(ckpt_dir), f"{key} has shape {got} in the checkpoint, the model needs {shape} "
                f"(model: vocab_size={args.vocab_size}, hidden_size={args.hidden_size}, num_layers="
                f"{args.num_layers}, num_heads={args.num_heads}, num_kv_heads={args.num_kv_heads}, head_dim="
                f"{args.head_dim}, intermediate_size={args.intermediate_size})",
                "set the model config the checkpoint was written with")
    # a model tensor of the checkpoint that we would not read is an architecture mismatch, never a silent drop
    extra = sorted(k for k in meta if k.startswith(_MODEL_PREFIXES) and k not in want)
    if extra:
        key = extra[0]
        switch = _SWITCH.get(key.removeprefix("decoder.layers."))
        if switch is not None:
            raise MegatronCheckpointError(switch[0], False, f"{ckpt_dir} has {switch[1]} ({key})",
                                          f"set {switch[0]}=true")
        if key == OUT:
            raise MegatronCheckpointError("model.tie_embeddings", True, f"{ckpt_dir} has an untied {OUT}",
                                          "set model.tie_embeddings=false")
        raise MegatronCheckpointError("checkpoint", str(ckpt_dir), f"has tensors the model has no parameter for: "
                                      f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} (another "
                                      "architecture, e.g. biases on every linear or LayerNorm biases)",
                                      "use a checkpoint of this architecture")
    if not args.tie_embeddings and OUT not in meta:
        raise MegatronCheckpointError("model.tie_embeddings", False, f"{ckpt_dir} has no {OUT}",
                                      "set model.tie_embeddings=true")
    return vp, meta[EMB].dtype


def load_megatron(ckpt_dir: str | Path, args: ModelArgs, tp: int, t: int, dtype: torch.dtype = torch.float32,
                  active: bool = True) -> dict[str, torch.Tensor] | None:
    """Native TP shard t of tp (our names, `dtype`) read from a dist_checkpointing checkpoint written at any
    layout, by megatron-core or by `save_megatron`. Collective over the world; ranks with `active=False` read
    nothing and return None."""
    import_megatron()
    from megatron.core import dist_checkpointing

    vp, ck_dtype = check_checkpoint(ckpt_dir, args)
    sd: dict = {}
    if active:
        chunks = plan_chunks(args, vp, tp, t)
        sd = _sharded(chunks, {c.name: torch.empty(c.shape, dtype=ck_dtype) for c in chunks}, args, 0, 0,
                      extra_state=False)
    with cpu_shim():
        loaded = dist_checkpointing.load(sd, str(ckpt_dir))
    if not active:
        return None
    flat = {c.name: loaded[c.name].reshape(c.shape) for c in chunks}
    return {k: v.to(dtype) for k, v in unpack(flat, args, tp, t).items()}


def save_actor_megatron(shard, ckpt_dir: str | Path, padded_vocab: int | None = None) -> Path:
    """`save_megatron` of an `ActorShard`'s weights (collective over the world)."""
    exp = shard.export_weights()
    if exp is None:
        return save_megatron(ckpt_dir, shard.args, None, shard.layout.tp, 0, 0, padded_vocab)
    d = shard.coord[1]
    return save_megatron(ckpt_dir, shard.args, exp.tensors, exp.tp, exp.t, d, padded_vocab)


__all__ = ["Chunk", "MegatronCheckpointError", "plan_chunks", "pack", "unpack", "save_megatron", "load_megatron",
           "check_checkpoint", "save_actor_megatron"]
