"""A Llama/Qwen-style decoder with Megatron-style tensor parallelism.

RMSNorm -> attention (RoPE, grouped-query, `scaled_dot_product_attention`) -> RMSNorm -> SwiGLU MLP, pre-norm
residuals, tied or untied embeddings. Parameter names and the RoPE convention (rotate-half) follow Hugging Face
Llama, so a checkpoint of a supported family loads with a rename table only (`tidal/engine/hf_checkpoint.py`).

The families differ in three switches of `ModelArgs`, each a parameter set or a formula, never a code fork:
    qkv_bias   q/k/v projections carry a bias (Qwen2, Qwen2.5)
    qk_norm    RMSNorm over each head's q and k before RoPE (Qwen3), with an explicit `head_dim`
    rope       RoPE frequencies: default, `linear` or `llama3` scaling (Llama 3.1 / 3.2)

Tensor parallelism (see `tidal/engine/tp.py`): q/k/v and gate/up are column-parallel (heads and SwiGLU width split),
o/down are row-parallel, the embedding and the output head are vocab-parallel; norms are replicated. A q/k/v
bias is split with its heads (TP dim 0, as the weight's rows); the q/k norms act on one head's dim and are
replicated, their gradients summed over the TP group (each rank normalizes only its own heads). With
`tp_group=None` it is the plain single-process model, used as the reference in tests.

Shapes: B batch, T query tokens, S key tokens, H heads (local), D head dim, V vocab (local shard).

KV cache hooks (generation): a `kv_cache` with `update(layer, k_BHTD, v_BHTD) -> (k_BHSD, v_BHSD)` stores the
new K/V and returns the keys to attend over (prefill: causal, or an explicit boolean `attn_mask_BTS`, True = may
attend); one with `attend(layer, q, k, v) -> out_BHTD` also does the attention (a decode step, whose rows read
key spans of their own). Positions are explicit per token so ragged batches work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tidal.core.errors import LayoutError
from tidal.engine.layout import ParamSpec
from tidal.engine.tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_vocab,
    group_rank,
    group_size,
    vocab_parallel_logprobs,
)

ROPE_TYPES = ("default", "linear", "llama3")

#: logits elements [rows x V_local] of one chunk of `Transformer.token_logprobs` (2^26: 256 MB in fp32)
LOGPROB_CHUNK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are derived from `rope_theta` (Hugging Face's `rope_type`s of that name).

    default: inv_freq_i = theta^(-2i/D).  linear: inv_freq / factor.  llama3: wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, shorter than ... /
    high_freq_factor are kept, and the band between is interpolated (Llama 3.1's long-context recipe)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise LayoutError("rope_scaling.rope_type", self.rope_type, "is not supported",
                              f"use one of {', '.join(ROPE_TYPES)}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise LayoutError("rope_scaling.factor", self.factor, "must be a finite number > 0", "e.g. 8.0")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise LayoutError("rope_scaling", (self.low_freq_factor, self.high_freq_factor),
                              "llama3 scaling needs high_freq_factor > low_freq_factor > 0", "e.g. 4.0 and 1.0")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int = 0
    """Per-head width; 0 derives it as hidden_size // num_heads (Qwen3 sets it explicitly)."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k before RoPE (Qwen3)."""
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if isinstance(self.rope_scaling, dict):  # from a checkpoint manifest (asdict form)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @staticmethod
    def from_config(model_cfg, vocab_size: int) -> ModelArgs:
        """From `tidal.core.config.ModelConfig`'s architecture keys (vocab from the tokenizer unless pinned). A
        config with `model.path` builds its args from the checkpoint instead (`hf_checkpoint.read_hf_config`)."""
        fields = {k: getattr(model_cfg, k) for k in ARCH_CONFIG_KEYS}
        fields["vocab_size"] = fields.get("vocab_size") or vocab_size
        return ModelArgs(**fields)

    def num_params(self) -> int:
        return sum(s.numel for s in param_specs(self))


#: `tidal.core.config.ModelConfig` keys that describe the architecture (and so come from config.json with model.path)
ARCH_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                    "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings")


class KVCache(Protocol):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    """`grad_group`: the TP group of a norm that acts on one rank's heads only (Qwen3's q/k norms): its weight is
    replicated, but each rank sees part of the heads, so its gradient is summed over the group (`copy_to_tp`)."""

    def __init__(self, dim: int, eps: float, dtype=torch.float32, device=None, grad_group=None):
        super().__init__()
        self.eps, self.grad_group = eps, grad_group
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))


    def forward(self, x: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
        return (kernels or EAGER).rms_norm(x, copy_to_tp(self.weight, self.grad_group), self.eps)


def rope_inv_freq(args: ModelArgs, device=None) -> torch.Tensor:
    """RoPE inverse frequencies [D/2] in fp64, after `args.rope_scaling`."""
    d, rs = args.head_dim, args.rope_scaling
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    if rs.rope_type == "linear":
        return inv / rs.factor
    if rs.rope_type == "llama3":
        old = rs.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rope_tables(args: ModelArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [max_seq_len, D] in fp32 (HF's rotate-half layout: frequencies repeated twice)."""
    inv = rope_inv_freq(args, device)
    t = torch.arange(args.max_seq_len, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    half = x_BHTD.shape[-1] // 2
    x1, x2 = x_BHTD[..., :half], x_BHTD[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_BTD.unsqueeze(1).to(x_BHTD.dtype), sin_BTD.unsqueeze(1).to(x_BHTD.dtype)
    return x_BHTD * cos + rotated * sin


# ---- the elementwise stages, as functions of tensors ---------------------------------------------------------
# A forward takes them as `Kernels` (default `EAGER`: what the actor, the scorers and CPU engines run); a
# generation engine on CUDA passes fused versions of the same math (`tidal.engine.generation.fused`).

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in fp32, scaled in the input dtype (Hugging Face Llama/Qwen's order of roundings)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum and its norm: (x + y, rms_norm(x + y))."""
    h = x + y
    return h, rms_norm(h, weight, eps)


def rope_qk(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope(q_BHTD, cos_BTD, sin_BTD), apply_rope(k_BHTD, cos_BTD, sin_BTD)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


@dataclass(frozen=True)
class Kernels:
    """The elementwise stages a forward runs (see above), and whether it uses packed projections where a layer
    has them (`Transformer.pack_projections`). One forward's choice: a scorer sharing an engine's model computes
    with `EAGER` and the separate projections whatever the engine runs."""

    packed: bool = False
    rms_norm: Callable[..., torch.Tensor] = rms_norm
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rms_norm
    rope_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_qk
    silu_mul: Callable[..., torch.Tensor] = silu_mul


EAGER = Kernels()


def _pack(linears: list[ColumnParallelLinear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) holding `linears`' rows in order; each linear's parameters become views of it, so a
    weight update (`param.copy_`) writes the packed tensor too."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([cast(torch.Tensor, lin.bias).detach() for lin in linears]) if linears[0].bias is not None \
        else None
    lo = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[lo:lo + n]
        if lin.bias is not None and bias is not None:
            lin.bias.data = bias[lo:lo + n]
        lo += n
    return weight, bias


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, group, dtype, device):
        super().__init__()
        tp = group_size(group)
        self.n_heads, self.n_kv, self.d = args.num_heads // tp, args.num_kv_heads // tp, args.head_dim
        h = args.hidden_size
        bias = args.qkv_bias
        self.q_proj = ColumnParallelLinear(h, args.num_heads * self.d, group, dtype, device, bias=bias)
        self.k_proj = ColumnParallelLinear(h, args.num_kv_heads * self.d, group, dtype, device, bias=bias)
        self.v_proj = ColumnParallelLinear(h, args.num_kv_heads * self.d, group, dtype, device, bias=bias)
        self.o_proj = RowParallelLinear(args.num_heads * self.d, h, group, dtype, device)
        if args.qk_norm:
            self.q_norm = RMSNorm(self.d, args.norm_eps, dtype, device, grad_group=group)
            self.k_norm = RMSNorm(self.d, args.norm_eps, dtype, device, grad_group=group)
        self.qk_norm = args.qk_norm
        #: q/k/v weight (and bias) packed into one GEMM (`Transformer.pack_projections`), else None
        self.packed: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def forward(self, x, cos, sin, mask_BTS, kv_cache, layer, kernels: Kernels = EAGER):
        b, t, _ = x.shape
        if kernels.packed and self.packed is not None:
            qkv = torch.nn.functional.linear(x, *self.packed)
            q, k, v = qkv.split([self.n_heads * self.d, self.n_kv * self.d, self.n_kv * self.d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k = q.view(b, t, self.n_heads, self.d), k.view(b, t, self.n_kv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q, kernels), self.k_norm(k, kernels)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.d).transpose(1, 2)
        attend = getattr(kv_cache, "attend", None)
        if attend is not None and getattr(kv_cache, "rotates_qk", False):
            out = attend(layer, q, k, v, cos, sin)   # a fused decode step: its kernel applies RoPE too
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.d))
        q, k = kernels.rope_qk(q, k, cos, sin)
        if attend is not None:   # a decode step: the cache writes the new K/V and attends over what each row needs
            out = attend(layer, q, k, v)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.d))
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)
        gqa: dict[str, Any] = {}
        if self.n_kv != self.n_heads:
            if q.is_cuda:  # fused GQA: no copy of the whole KV cache per decode step
                gqa = {"enable_gqa": True}
            else:  # CPU: expand kv heads (the path the CPU bit-exactness tests pin down)
                rep = self.n_heads // self.n_kv
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask_BTS is None:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask_BTS.unsqueeze(1), **gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.d))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, group, dtype, device):
        super().__init__()
        h, f = args.hidden_size, args.intermediate_size
        self.gate_proj = ColumnParallelLinear(h, f, group, dtype, device)
        self.up_proj = ColumnParallelLinear(h, f, group, dtype, device)
        self.down_proj = RowParallelLinear(f, h, group, dtype, device)
        #: gate/up weight packed into one GEMM (`Transformer.pack_projections`), else None
        self.packed: torch.Tensor | None = None

    def forward(self, x, kernels: Kernels = EAGER):
        if kernels.packed and self.packed is not None:
            gate, up = torch.nn.functional.linear(x, self.packed).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(kernels.silu_mul(gate, up))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, group, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.norm_eps, dtype, device)
        self.self_attn = Attention(args, group, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.norm_eps, dtype, device)
        self.mlp = MLP(args, group, dtype, device)

    def forward(self, x, cos, sin, mask, kv_cache, layer, kernels: Kernels = EAGER):
        attn = self.self_attn(self.input_layernorm(x, kernels), cos, sin, mask, kv_cache, layer, kernels)
        norm = self.post_attention_layernorm   # replicated weight (no TP gradient hook): the fused residual + norm
        x, h = kernels.add_rms_norm(x, attn, norm.weight, norm.eps)
        return x + self.mlp(h, kernels)


def compute_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """`actor.dtype` on `device`: `auto` is bf16 on CUDA (fp32 master weights stay in the optimizer) and fp32
    elsewhere; `float32` and `bfloat16` are what they say. The actor and the engines compute in it."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def check_tp(args: ModelArgs, tp: int) -> None:
    """TP must split heads and kv heads evenly (vocab and SwiGLU width may split unevenly)."""
    if args.num_heads % tp or args.num_kv_heads % tp:
        raise LayoutError("tp", tp, f"does not divide num_heads={args.num_heads} and "
                          f"num_kv_heads={args.num_kv_heads}", "use a TP size that divides both")


class Transformer(nn.Module):
    """The decoder. `tp_group`: the TP process group of this rank (None: single process)."""

    rope_cos: torch.Tensor  # buffers (register_buffer below)
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs, tp_group=None, dtype=torch.float32, device=None):
        super().__init__()
        check_tp(args, group_size(tp_group))
        self.args, self.tp_group = args, tp_group
        #: recompute each layer's activations in the backward (`actor.activation_checkpointing`)
        self.activation_checkpointing = False
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp_group, dtype, device)
        self.layers = nn.ModuleList(Block(args, tp_group, dtype, device) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps, dtype, device)
        if not args.tie_embeddings:
            self.lm_head = ColumnParallelLinear(args.hidden_size, args.vocab_size, tp_group, dtype, device)
        cos, sin = rope_tables(args, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def vocab_lo(self) -> int:
        return self.embed_tokens.vocab_lo

    @torch.no_grad()
    def pack_projections(self, packed: bool = True) -> None:
        """Inference: q/k/v and gate/up of every layer as one GEMM each (their parameters become views of the
        packed weights, so `param.copy_` updates both). `packed=False` drops the packed weights (before the
        parameters are freed or replaced)."""
        for layer in cast(list[Block], list(self.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            attn.packed = _pack([attn.q_proj, attn.k_proj, attn.v_proj]) if packed else None
            mlp.packed = _pack([mlp.gate_proj, mlp.up_proj])[0] if packed else None

    def hidden(self, ids_BT, positions_BT=None, attn_mask_BTS=None, kv_cache: KVCache | None = None,
               kernels: Kernels = EAGER):
        if positions_BT is None:
            positions_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
        x = self.embed_tokens(ids_BT)
        # in the compute dtype once per forward, not in every layer's q and k rotation
        cos, sin = self.rope_cos[positions_BT].to(x.dtype), self.rope_sin[positions_BT].to(x.dtype)
        recompute = self.activation_checkpointing and torch.is_grad_enabled() and kv_cache is None
        for i, layer in enumerate(self.layers):
            if recompute:   # keep each layer's input only; its activations are recomputed in the backward
                x = checkpoint(layer, x, cos, sin, attn_mask_BTS, None, i, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn_mask_BTS, kv_cache, i, kernels)
        return self.norm(x, kernels)

    def logits_local(self, h_BTH: torch.Tensor) -> torch.Tensor:
        """Vocab-sharded logits [B, T, V_local] (this rank's vocab range)."""
        w = self.embed_tokens.weight if self.args.tie_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(copy_to_tp(h_BTH, self.tp_group), w)

    def forward(self, ids_BT, positions_BT=None, attn_mask_BTS=None, kv_cache: KVCache | None = None,
                kernels: Kernels = EAGER):
        """Vocab-sharded logits of every position."""
        return self.logits_local(self.hidden(ids_BT, positions_BT, attn_mask_BTS, kv_cache, kernels))

    def full_logits(self, logits_local: torch.Tensor) -> torch.Tensor:
        return gather_vocab(logits_local, self.tp_group, self.args.vocab_size)

    def token_logprobs(self, ids_BT: torch.Tensor, attn_mask_BTS=None, positions_BT=None) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]) for t < T-1: shape [B, T-1], fp32, TP-exact (`token_logprobs_entropy`
        without the entropy)."""
        return self.token_logprobs_entropy(ids_BT, attn_mask_BTS, positions_BT, with_entropy=False)[0]

    def token_logprobs_entropy(self, ids_BT: torch.Tensor, attn_mask_BTS=None, positions_BT=None,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log p(ids[:, t+1] | ids[:, :t+1]), the entropy of p(. | ids[:, :t+1]) without grad, or None) for
        t < T-1: each [B, T-1], fp32, TP-exact.

        The [B, T-1, V] logits are never whole when they exceed `LOGPROB_CHUNK_ELEMENTS`: rows of positions go
        through the head and the log-softmax a chunk at a time, each chunk recomputed in the backward (so a
        chunk's fp32 logits are the largest activation; 8 x 2,048 tokens at vocab 151,936 would otherwise hold
        about 10 GB). Chunks are a function of the shape alone, so two calls on equal shapes compute alike."""
        h = self.hidden(ids_BT, positions_BT, attn_mask_BTS)
        targets = ids_BT[:, 1:]
        b, t, dim = h.shape[0], h.shape[1] - 1, h.shape[2]
        rows = max(64, LOGPROB_CHUNK_ELEMENTS // max(1, self.embed_tokens.weight.shape[0]))
        if b * t <= rows:
            return self._logprobs(h, targets, with_entropy, drop_last=True)
        h_N, t_N = h[:, :-1].reshape(b * t, dim), targets.reshape(b * t)
        grad = torch.is_grad_enabled() and h_N.requires_grad
        out = [checkpoint(self._logprobs, h_N[lo:lo + rows], t_N[lo:lo + rows], with_entropy, use_reentrant=False)
               if grad else self._logprobs(h_N[lo:lo + rows], t_N[lo:lo + rows], with_entropy)
               for lo in range(0, b * t, rows)]
        lp = torch.cat([o[0] for o in out]).view(b, t)
        return lp, torch.cat([cast(torch.Tensor, o[1]) for o in out]).view(b, t) if with_entropy else None

    def _logprobs(self, h: torch.Tensor, targets: torch.Tensor, with_entropy: bool,
                  drop_last: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropy or None) of `targets` from hidden states `h` (`drop_last`: h has one more
        position than targets, whose logits are computed and dropped, as the unchunked path always did)."""
        logits = self.logits_local(h)
        out = vocab_parallel_logprobs(logits[:, :-1] if drop_last else logits, targets, self.tp_group,
                                      self.vocab_lo, with_entropy)
        return out if with_entropy else (out, None)

    # ---- weights ------------------------------------------------------------------------------------
    def specs(self) -> dict[str, ParamSpec]:
        return {s.name: s for s in param_specs(self.args)}

    @torch.no_grad()
    def load_global(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's TP shard of each global tensor into the module (names as in `param_specs`)."""
        tp, t = group_size(self.tp_group), group_rank(self.tp_group)
        specs = self.specs()
        own = dict(self.named_parameters())
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"weights missing for {missing[:5]}{'...' if len(missing) > 5 else ''}")
        for name, p in own.items():
            spec = specs[name]
            src = state[name]
            if tuple(src.shape) != spec.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} does not match the model's {spec.shape}")
            p.copy_(src[spec.tp_slices(tp, t)])


def param_specs(args: ModelArgs) -> list[ParamSpec]:
    """Every parameter's global shape and TP dim, in module order (the state inventory's order)."""
    h, d, v, f = args.hidden_size, args.head_dim, args.vocab_size, args.intermediate_size
    out = [ParamSpec("embed_tokens.weight", (v, h), 0)]
    for i in range(args.num_layers):
        p = f"layers.{i}."
        attn = []
        for name, rows in (("q", args.num_heads * d), ("k", args.num_kv_heads * d), ("v", args.num_kv_heads * d)):
            attn.append(ParamSpec(p + f"self_attn.{name}_proj.weight", (rows, h), 0))
            if args.qkv_bias:  # split with its heads, like the weight's rows
                attn.append(ParamSpec(p + f"self_attn.{name}_proj.bias", (rows,), 0))
        attn.append(ParamSpec(p + "self_attn.o_proj.weight", (h, args.num_heads * d), 1))
        if args.qk_norm:
            attn += [ParamSpec(p + "self_attn.q_norm.weight", (d,), None),
                     ParamSpec(p + "self_attn.k_norm.weight", (d,), None)]
        out += [ParamSpec(p + "input_layernorm.weight", (h,), None), *attn]
        out += [
            ParamSpec(p + "post_attention_layernorm.weight", (h,), None),
            ParamSpec(p + "mlp.gate_proj.weight", (f, h), 0),
            ParamSpec(p + "mlp.up_proj.weight", (f, h), 0),
            ParamSpec(p + "mlp.down_proj.weight", (h, f), 1),
        ]
    out.append(ParamSpec("norm.weight", (h,), None))
    if not args.tie_embeddings:
        out.append(ParamSpec("lm_head.weight", (v, h), 0))
    return out


def init_global_weights(args: ModelArgs, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic fp32 global weights (normal std 0.02, output projections scaled by 1/sqrt(2 L), norms 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in param_specs(args):
        if spec.name.endswith("norm.weight"):
            out[spec.name] = torch.ones(spec.shape)
            continue
        if spec.name.endswith(".bias"):
            out[spec.name] = torch.zeros(spec.shape)
            continue
        std = 0.02
        if spec.name.endswith(("o_proj.weight", "down_proj.weight")):
            std = 0.02 / (2 * args.num_layers) ** 0.5
        out[spec.name] = torch.randn(spec.shape, generator=g) * std
    return out
