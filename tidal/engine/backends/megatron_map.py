"""Name and layout mapping between our model (HF Llama names) and megatron-core's GPTModel.

Torch only: megatron-core is imported lazily (in `transformer_config` and `gpt_layer_spec`), so this module imports
without it.

Three namespaces for the same weights::

    ours (param_specs)                    GPTModel module (local spec)              dist_checkpointing key
    embed_tokens.weight [V, h]            embedding.word_embeddings.weight [Vp, h]  same            [Vp, h]
    layers.i.input_layernorm.weight       decoder.layers.i.input_layernorm.weight   decoder.layers.self_attention.
                                                                                      linear_qkv.layer_norm_weight
                                                                                      [L, h]
    layers.i.self_attn.{q,k,v}_proj       decoder.layers.i.self_attention.          decoder.layers.self_attention.
                                            linear_qkv.weight (fused, see below)      linear_qkv.weight [L, G(r+2)D, h]
    layers.i.self_attn.{q,k,v}_proj.bias  ...self_attention.linear_qkv.bias         ...linear_qkv.bias [L, G(r+2)D]
      (qkv_bias: Qwen2)                     (fused like the weight's rows)
    layers.i.self_attn.{q,k}_norm.weight  ...self_attention.{q,k}_layernorm.weight  ...{q,k}_layernorm.weight [L, D]
      (qk_norm: Qwen3)                      (replicated over TP)
    layers.i.self_attn.o_proj.weight      ...self_attention.linear_proj.weight      ...linear_proj.weight [L, h, HD]
    layers.i.post_attention_layernorm     ...pre_mlp_layernorm.weight               decoder.layers.mlp.linear_fc1.
                                                                                      layer_norm_weight [L, h]
    layers.i.mlp.{gate,up}_proj.weight    ...mlp.linear_fc1.weight (fused)          ...linear_fc1.weight [L, 2F, h]
    layers.i.mlp.down_proj.weight         ...mlp.linear_fc2.weight                  ...linear_fc2.weight [L, h, F]
    norm.weight                           decoder.final_layernorm.weight            same
    lm_head.weight [V, h]                 output_layer.weight [Vp, h]               same (absent when tied)

The checkpoint keys are the Transformer-Engine spelling (norms fused into the following linear) with the layers
stacked on a prepended axis, which is what megatron-core writes for the local spec too, so a checkpoint moves
between TE and non-TE models and between Tidal and Megatron-LM unchanged.

**Fused QKV** (H heads, G kv groups, r = H / G, D head dim): rows are grouped by kv group, each group holding its
r query heads, then its key head, then its value head::

    [q(g0,h0) .. q(g0,h_{r-1}) k(g0) v(g0) | q(g1,h0) ... k(g1) v(g1) | ...]      each block D rows

Query head j belongs to group j // r, which is exactly our GQA rule (`repeat_interleave(r)` of kv heads). Megatron
splits the fused rows evenly over TP, i.e. whole groups; our q/k/v TP shards hold the same groups (TP divides G),
so a TP-local fused tensor is the fuse of TP-local q, k, v.

**Fused SwiGLU** `linear_fc1`: a TP rank holds `[gate_t; up_t]` (its gate rows, then its up rows); the global
checkpoint tensor is `[gate; up]` (megatron-core's swiglu sharded factory writes gate shard t at chunk t and up
shard t at chunk tp + t of 2 tp), independent of TP.

**Vocab padding**: Megatron-LM pads the vocab to a multiple of `make_vocab_size_divisible_by * tp` (default 128),
so the padded size Vp is a property of a checkpoint (read it from the file, never recompute it on load). We write
padded rows as zeros and drop them on read; logits of the real vocab are unaffected (their softmax in Megatron's
loss sees Vp - V extra zero-weight columns, logit 0; Megatron-LM initializes them randomly instead).

Megatron needs H, G and F divisible by TP (`check_megatron_tp`); our own floor splits do not.

**Model families** (`ModelArgs` switches) and what megatron-core 0.16.1 makes of them (`transformer_config`,
`gpt_layer_spec`, `gpt_model_kwargs`):

    head_dim         kv_channels (any value: Megatron's attention width is kv_channels * heads, like ours)
    qkv_bias         add_qkv_bias=True with add_bias_linear=False: a bias on linear_qkv only
    qk_norm          qk_layernorm=True + the local spec's q/k_layernorm (torch RMSNorm over each head's D,
                     eps = norm_eps), applied before RoPE as ours; replicated over TP, their grads summed over TP
                     (megatron-core's `_allreduce_non_tensor_model_parallel_grads`, which the backend calls)
    rope linear      seq_len_interpolation_factor=factor (positions / factor == inv_freq / factor)
    rope llama3      rope_scaling=True, rope_scaling_factor=factor; megatron-core hard-codes low_freq_factor=1,
                     high_freq_factor=4, original_max_position_embeddings=8192 (Llama 3.1 / 3.2's values), so
                     other values are a `LayoutError` naming the field (`check_megatron_args`)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

import torch

from tidal.core.errors import ConfigError, LayoutError
from tidal.engine.model import ModelArgs

# per-layer: our suffix -> (GPTModel module suffix, checkpoint key suffix); fused ones are handled apart
_LAYER_NORMS = {
    "input_layernorm.weight": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
}
_LAYER_LINEARS = {  # unfused linears: (module suffix, checkpoint suffix, TP dim)
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", "self_attention.linear_proj.weight", 1),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", 1),
}
QKV = "self_attention.linear_qkv.weight"
QKV_BIAS = "self_attention.linear_qkv.bias"
QK_NORMS = {"q_norm.weight": "self_attention.q_layernorm.weight",   # ours (after self_attn.) -> Megatron's
            "k_norm.weight": "self_attention.k_layernorm.weight"}
FC1 = "mlp.linear_fc1.weight"
#: megatron-core's llama3 RoPE scaling: only `factor` is a parameter (RotaryEmbedding._apply_scaling's defaults)
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
EXTRA_STATE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                       "mlp.linear_fc2")


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: round up to a multiple of `divisible_by * tp`."""
    if divisible_by < 1:
        raise LayoutError("megatron.make_vocab_size_divisible_by", divisible_by, "must be >= 1", "use 128 (default)")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_megatron_args(args: ModelArgs) -> None:
    """Everything of `args` that megatron-core's GPTModel can express, or a LayoutError naming the field."""
    rs = args.rope_scaling
    if rs.rope_type == "llama3":
        for field, fixed in MEGATRON_LLAMA3_FIXED.items():
            if getattr(rs, field) != fixed:
                raise LayoutError(f"model.rope_scaling.{field}", getattr(rs, field),
                                  f"megatron-core 0.16.1's llama3 RoPE scaling fixes {field}={fixed} "
                                  "(only the factor is configurable)",
                                  f"use {field}={fixed} or the native backend")


def check_megatron_tp(args: ModelArgs, tp: int) -> None:
    """Megatron splits heads, kv groups and the SwiGLU width evenly over TP (and needs G >= TP)."""
    for field, n in (("num_heads", args.num_heads), ("num_kv_heads", args.num_kv_heads),
                     ("intermediate_size", args.intermediate_size)):
        if n % tp:
            raise LayoutError("tp", tp, f"does not divide model.{field}={n} (megatron-core splits it evenly)",
                              f"use a TP size that divides model.{field}")


@dataclass(frozen=True)
class QKVShape:
    """Fused-QKV geometry: G groups of r query heads + 1 key + 1 value head, each D rows."""

    groups: int
    rep: int
    head_dim: int

    @staticmethod
    def of(args: ModelArgs) -> QKVShape:
        return QKVShape(args.num_kv_heads, args.num_heads // args.num_kv_heads, args.head_dim)

    @property
    def rows_per_group(self) -> int:
        return (self.rep + 2) * self.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: QKVShape) -> torch.Tensor:
    """[g*r*D, h], [g*D, h], [g*D, h] (any whole number g of groups) -> fused [g*(r+2)*D, h]."""
    d, r = shape.head_dim, shape.rep
    g = k.shape[0] // d
    assert q.shape[0] == g * r * d and v.shape[0] == g * d, (q.shape, k.shape, v.shape, shape)
    cols = q.shape[1:]
    parts = (q.reshape(g, r * d, *cols), k.reshape(g, d, *cols), v.reshape(g, d, *cols))
    return torch.cat(parts, dim=1).reshape(g * (r + 2) * d, *cols)


def split_qkv(qkv: torch.Tensor, shape: QKVShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv` (contiguous copies)."""
    d, r = shape.head_dim, shape.rep
    g = qkv.shape[0] // shape.rows_per_group
    assert g * shape.rows_per_group == qkv.shape[0], (qkv.shape, shape)
    cols = qkv.shape[1:]
    grouped = qkv.reshape(g, (r + 2) * d, *cols)
    q, k, v = grouped.split([r * d, d, d], dim=1)
    return (q.reshape(g * r * d, *cols).contiguous(), k.reshape(g * d, *cols).contiguous(),
            v.reshape(g * d, *cols).contiguous())


def pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """`w` with zero rows appended up to `rows`."""
    assert rows >= w.shape[0], (rows, w.shape)
    if rows == w.shape[0]:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


# ---- whole-model conversion (GPTModel module names, per layer) ----------------------------------------------
def _one_to_one(i: int) -> list[tuple[str, str]]:
    """(our name, GPTModel module name) of layer i's tensors that map one to one, either way: its two norms and
    its unfused linears (the fused and the optional ones convert apart)."""
    p, m = f"layers.{i}.", f"decoder.layers.{i}."
    return [(p + ours, m + mod) for ours, (mod, _) in _LAYER_NORMS.items()] + \
        [(p + ours, m + mod) for ours, (mod, _, _) in _LAYER_LINEARS.items()]


def to_megatron(state: dict[str, torch.Tensor], args: ModelArgs, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Our global weights -> GPTModel's global weights (module names of the local spec, TP = 1 shapes)."""
    qs = QKVShape.of(args)
    out = {"embedding.word_embeddings.weight": pad_rows(state["embed_tokens.weight"], padded_vocab)}
    for i in range(args.num_layers):
        p, m = f"layers.{i}.", f"decoder.layers.{i}."
        for ours, mod in _one_to_one(i):
            out[mod] = state[ours]
        a = p + "self_attn."
        out[m + QKV] = fuse_qkv(state[a + "q_proj.weight"], state[a + "k_proj.weight"], state[a + "v_proj.weight"], qs)
        if args.qkv_bias:
            out[m + QKV_BIAS] = fuse_qkv(state[a + "q_proj.bias"], state[a + "k_proj.bias"], state[a + "v_proj.bias"],
                                         qs)
        if args.qk_norm:
            for ours, mod in QK_NORMS.items():
                out[m + mod] = state[a + ours]
        out[m + FC1] = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
    out["decoder.final_layernorm.weight"] = state["norm.weight"]
    if not args.tie_embeddings:
        out["output_layer.weight"] = pad_rows(state["lm_head.weight"], padded_vocab)
    return out


def from_megatron(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """GPTModel's global weights (module names, TP = 1) -> ours; padded vocab rows are dropped."""
    qs, v, f = QKVShape.of(args), args.vocab_size, args.intermediate_size
    out = {"embed_tokens.weight": state["embedding.word_embeddings.weight"][:v]}
    for i in range(args.num_layers):
        p, m = f"layers.{i}.", f"decoder.layers.{i}."
        for ours, mod in _one_to_one(i):
            out[ours] = state[mod]
        q, k, vv = split_qkv(state[m + QKV], qs)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
        out[p + "self_attn.v_proj.weight"] = vv
        a = p + "self_attn."
        if args.qkv_bias:
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = split_qkv(state[m + QKV_BIAS], qs)
        if args.qk_norm:
            for ours, mod in QK_NORMS.items():
                out[a + ours] = state[m + mod]
        fc1 = state[m + FC1]
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
    out["norm.weight"] = state["decoder.final_layernorm.weight"]
    if not args.tie_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"][:v]
    return out


def megatron_tp_shard(state: dict[str, torch.Tensor], args: ModelArgs, tp: int, t: int) -> dict[str, torch.Tensor]:
    """TP rank t's shard of GPTModel global weights (from `to_megatron`), as GPTModel at TP = tp holds it."""
    check_megatron_tp(args, tp)
    out = {}
    for name, w in state.items():
        if name.endswith(("layernorm.weight",)) or name == "decoder.final_layernorm.weight":
            out[name] = w
        elif name.endswith((QKV, QKV_BIAS, "word_embeddings.weight", "output_layer.weight")):
            out[name] = w.chunk(tp, dim=0)[t]  # whole kv groups / equal padded-vocab ranges
        elif name.endswith(FC1):
            gate, up = w.chunk(2, dim=0)
            out[name] = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            out[name] = w.chunk(tp, dim=1)[t]
        else:
            raise KeyError(f"no TP rule for {name}")
    return {k: v.contiguous() for k, v in out.items()}


# ---- megatron-core configuration --------------------------------------------------------------------------
def transformer_config(args: ModelArgs, tp: int = 1, dtype: torch.dtype = torch.float32, **overrides):
    """megatron-core `TransformerConfig` for our model: RMSNorm, SwiGLU without biases (a qkv bias with
    `qkv_bias`), GQA, per-head q/k RMSNorm with `qk_norm`, RoPE (rotate-half), no dropout (our model has none).
    CUDA-only fusions are off so the same config runs on CPU; on GPU pass overrides such as
    `bias_activation_fusion=True`. Imports megatron-core (lazily)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_megatron_args(args)
    check_megatron_tp(args, tp)
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads, kv_channels=args.head_dim, ffn_hidden_size=args.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=args.norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, pipeline_dtype=dtype,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


#: the config key that picks the layer spec (tidal/core/config.py)
TE_KEY = "actor.megatron_transformer_engine"
TE_MODULE = "transformer_engine"
#: GPTModel parameter names (after `decoder.layers.i.`) of the TE spec -> the local spec's: TE fuses each
#: pre-norm into the linear after it (the checkpoint keys are these TE names for both specs, module doc)
TE_PARAM_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                  "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


@dataclass(frozen=True)
class LayerSpecChoice:
    """Which megatron-core layer spec the Megatron actor builds, and why (the backend's build record)."""

    transformer_engine: bool
    """True: `get_gpt_layer_with_transformer_engine_spec`; False: `get_gpt_layer_local_spec`."""
    reason: str
    """The setting and what was found, e.g. "auto: transformer_engine is not importable"."""

    def __str__(self) -> str:
        return f"{'transformer_engine' if self.transformer_engine else 'local'} ({self.reason})"


def te_importable() -> bool:
    """Whether `import transformer_engine` succeeds here (megatron-core's own test for its TE modules)."""
    try:
        importlib.import_module(TE_MODULE)
    except (ImportError, OSError):   # OSError: installed, but its CUDA libraries do not load
        return False
    return True


def choose_layer_spec(setting: bool | Literal["auto"], importable: bool) -> LayerSpecChoice:
    """The layer spec for `actor.megatron_transformer_engine` = `setting` where Transformer Engine is (not)
    `importable`: auto takes TE where it imports; true without it is a ConfigError naming the key and the fix."""
    if setting == "auto":
        return LayerSpecChoice(importable, f"auto: {TE_MODULE} is {'' if importable else 'not '}importable")
    if setting is True and not importable:
        raise ConfigError(TE_KEY, True, f"needs Transformer Engine, but `import {TE_MODULE}` fails here",
                          f"install it (pip install 'transformer_engine[pytorch]', CUDA only), or set {TE_KEY}: auto "
                          "(TE where it imports, megatron-core's local spec elsewhere) or false")
    return LayerSpecChoice(bool(setting), f"{TE_KEY}: {str(bool(setting)).lower()}")


def local_param_name(name: str, transformer_engine: bool) -> str:
    """A GPTModel parameter name in the local spec's spelling (the identity without TE)."""
    if not transformer_engine:
        return name
    head, sep, tail = name.partition("decoder.layers.")
    if sep:
        i, _, rest = tail.partition(".")
        if rest in TE_PARAM_NAMES:
            return f"{head}decoder.layers.{i}.{TE_PARAM_NAMES[rest]}"
    return name


def gpt_layer_spec(args: ModelArgs, transformer_engine: bool = False):
    """The GPTModel layer spec for our model: megatron-core's local spec (torch modules), or with
    `transformer_engine` its TE spec (norms fused into the next linear: `TE_PARAM_NAMES`); RMSNorm from the
    TransformerConfig, q/k_layernorm when `qk_norm`. Imports megatron-core (lazily)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if transformer_engine:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_norm)
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=args.qk_norm)


def gpt_model_kwargs(args: ModelArgs, padded_vocab: int) -> dict:
    """The GPTModel constructor arguments that come from our model (besides config and layer spec), RoPE scaling
    included (module doc); raises LayoutError for what megatron-core cannot express."""
    check_megatron_args(args)
    rs = args.rope_scaling
    rope: dict = {}
    if rs.rope_type == "linear":
        rope = dict(seq_len_interpolation_factor=rs.factor)
    elif rs.rope_type == "llama3":
        rope = dict(rope_scaling=True, rope_scaling_factor=rs.factor)
    return dict(vocab_size=padded_vocab, max_sequence_length=args.max_seq_len, position_embedding_type="rope",
                rotary_base=args.rope_theta, rotary_percent=1.0,
                share_embeddings_and_output_weights=args.tie_embeddings, **rope)


__all__ = ["TE_KEY", "TE_PARAM_NAMES", "LayerSpecChoice", "te_importable", "choose_layer_spec", "local_param_name",
           "padded_vocab_size", "check_megatron_args", "check_megatron_tp", "QKVShape", "fuse_qkv", "split_qkv",
           "pad_rows", "to_megatron", "from_megatron", "megatron_tp_shard", "transformer_config", "gpt_layer_spec",
           "gpt_model_kwargs", "QKV", "QKV_BIAS", "QK_NORMS", "FC1", "MEGATRON_LLAMA3_FIXED", "EXTRA_STATE_LINEARS"]
