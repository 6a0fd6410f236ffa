"""A Llama/Qwen-style decoder with Megatron-style tensor parallelism.

RMSNorm -> attention (RoPE, grouped-query, `scaled_dot_product_attention`) -> RMSNorm -> SwiGLU MLP, pre-norm
residuals, tied or untied embeddings. Parameter names and the RoPE convention (rotate-half) follow Hugging Face
Llama so its safetensors load with a rename table only (see `engine/checkpoint_hf.py` where present).

Tensor parallelism (see `engine/tp.py`): q/k/v and gate/up are column-parallel (heads and SwiGLU width split),
o/down are row-parallel, the embedding and the output head are vocab-parallel; norms are replicated. With
`tp_group=None` it is the plain single-process model, used as the reference in tests.

Shapes: B batch, T query tokens, S key tokens, H heads (local), D head dim, V vocab (local shard).

KV cache hook (generation): pass `kv_cache` with `update(layer, k_BHTD, v_BHTD) -> (k_BHSD, v_BHSD)` and an
explicit boolean `attn_mask_BTS` (True = may attend); positions are explicit per token so ragged batches work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tidal.engine.layout import ParamSpec
from tidal.errors import LayoutError
from tidal.engine.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, _rank, _size,
                             copy_to_tp, gather_vocab, vocab_parallel_logprobs)


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def from_config(model_cfg, vocab_size: int) -> "ModelArgs":
        """From `tidal.config.ModelConfig` (vocab from the tokenizer unless the config pins it)."""
        fields = model_cfg.model_dump()
        fields["vocab_size"] = fields.get("vocab_size") or vocab_size
        return ModelArgs(**fields)

    def num_params(self) -> int:
        return sum(s.numel for s in param_specs(self))


class KVCache(Protocol):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(args: ModelArgs, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [max_seq_len, D] in fp32 (HF's rotate-half layout: frequencies repeated twice)."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, group, dtype, device):
        super().__init__()
        tp = _size(group)
        self.n_heads, self.n_kv, self.d = args.num_heads // tp, args.num_kv_heads // tp, args.head_dim
        h = args.hidden_size
        self.q_proj = ColumnParallelLinear(h, args.num_heads * self.d, group, dtype, device)
        self.k_proj = ColumnParallelLinear(h, args.num_kv_heads * self.d, group, dtype, device)
        self.v_proj = ColumnParallelLinear(h, args.num_kv_heads * self.d, group, dtype, device)
        self.o_proj = RowParallelLinear(args.num_heads * self.d, h, group, dtype, device)

    def forward(self, x, cos, sin, mask_BTS, kv_cache, layer):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.d).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)
        gqa = {}
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

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, group, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.norm_eps, dtype, device)
        self.self_attn = Attention(args, group, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.norm_eps, dtype, device)
        self.mlp = MLP(args, group, dtype, device)

    def forward(self, x, cos, sin, mask, kv_cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def check_tp(args: ModelArgs, tp: int) -> None:
    """TP must split heads and kv heads evenly (vocab and SwiGLU width may split unevenly)."""
    if args.num_heads % tp or args.num_kv_heads % tp:
        raise LayoutError("tp", tp, f"does not divide num_heads={args.num_heads} and "
                          f"num_kv_heads={args.num_kv_heads}", "use a TP size that divides both")


class Transformer(nn.Module):
    """The decoder. `tp_group`: the TP process group of this rank (None: single process)."""

    def __init__(self, args: ModelArgs, tp_group=None, dtype=torch.float32, device=None):
        super().__init__()
        check_tp(args, _size(tp_group))
        self.args, self.tp_group = args, tp_group
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

    def hidden(self, ids_BT, positions_BT=None, attn_mask_BTS=None, kv_cache: KVCache | None = None):
        if positions_BT is None:
            positions_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
        cos, sin = self.rope_cos[positions_BT], self.rope_sin[positions_BT]
        x = self.embed_tokens(ids_BT)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn_mask_BTS, kv_cache, i)
        return self.norm(x)

    def logits_local(self, h_BTH: torch.Tensor) -> torch.Tensor:
        """Vocab-sharded logits [B, T, V_local] (this rank's vocab range)."""
        w = self.embed_tokens.weight if self.args.tie_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(copy_to_tp(h_BTH, self.tp_group), w)

    def forward(self, ids_BT, positions_BT=None, attn_mask_BTS=None, kv_cache: KVCache | None = None):
        """Vocab-sharded logits of every position."""
        return self.logits_local(self.hidden(ids_BT, positions_BT, attn_mask_BTS, kv_cache))

    def full_logits(self, logits_local: torch.Tensor) -> torch.Tensor:
        return gather_vocab(logits_local, self.tp_group, self.args.vocab_size)

    def token_logprobs(self, ids_BT: torch.Tensor, attn_mask_BTS=None, positions_BT=None) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]) for t < T-1: shape [B, T-1], fp32, TP-exact."""
        logits = self.forward(ids_BT, positions_BT, attn_mask_BTS)[:, :-1]
        return vocab_parallel_logprobs(logits, ids_BT[:, 1:], self.tp_group, self.vocab_lo)

    # ---- weights ------------------------------------------------------------------------------------
    def specs(self) -> dict[str, ParamSpec]:
        return {s.name: s for s in param_specs(self.args)}

    @torch.no_grad()
    def load_global(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's TP shard of each global tensor into the module (names as in `param_specs`)."""
        tp, t = _size(self.tp_group), _rank(self.tp_group)
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
        out += [
            ParamSpec(p + "input_layernorm.weight", (h,), None),
            ParamSpec(p + "self_attn.q_proj.weight", (args.num_heads * d, h), 0),
            ParamSpec(p + "self_attn.k_proj.weight", (args.num_kv_heads * d, h), 0),
            ParamSpec(p + "self_attn.v_proj.weight", (args.num_kv_heads * d, h), 0),
            ParamSpec(p + "self_attn.o_proj.weight", (h, args.num_heads * d), 1),
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
        if spec.name.endswith("layernorm.weight") or spec.name == "norm.weight":
            out[spec.name] = torch.ones(spec.shape)
            continue
        std = 0.02
        if spec.name.endswith(("o_proj.weight", "down_proj.weight")):
            std = 0.02 / (2 * args.num_layers) ** 0.5
        out[spec.name] = torch.randn(spec.shape, generator=g) * std
    return out
