"""Decode-step GEMMs for the CUDA engine in Triton: weight-streaming tiles with the elementwise stages fused in.

At decode a layer's GEMMs have a few dozen rows (the running requests) and read 94 MB of weights (Qwen2.5-1.5B):
they are bound by the weight read, not by arithmetic. cuBLAS reaches 0.72 of it on gate/up and far less on the
small q/k/v and o projections (latency-bound at a few microseconds each), and the norms, SiLU product and
residual adds between them are launches of their own. Here a layer is six launches besides attention:

    qkv      x_n @ W_qkv^T + b              tiles of BLOCK_N output columns over the whole K (one pass)
    o        attn @ W_o^T                   split-K: fp32 partial sums [S, M, N] of fixed K ranges
    norm     x += sum_s(partials); x_n = rms_norm(x) * w      (`reduce_add_rms_norm`: residual add + next norm)
    gate/up  silu(x_n @ W_g^T) * (x_n @ W_u^T)                 both tiles in one program, the product stored
    down     act @ W_d^T                    split-K partials
    norm     the same for the MLP's output, with the next layer's input norm (the final norm after the last)

Invariant (batch invariance of a row): a row's output depends on its own inputs and the weights only. The K
ranges of the splits and the BLOCK_K steps inside them are fixed by (N, K) alone (`GemmConfig`), partial sums
are added in split order 0, 1, ..., and the M tiling never changes which products a row's sum adds or in which
order; so a row's bits do not depend on how many rows the step runs or which of them share its tile. No atomics
touch data.

Roundings follow the eager model: each GEMM's output rounds once to the compute dtype (bias added in fp32
before), the residual sum rounds, the norm is taken in fp32 of the rounded sum and its scale multiplies in the
compute dtype (`tidal.engine.model.rms_norm`), SiLU's product is computed in fp32 from the rounded gate and up
and rounded once (the compiled `silu_mul`). The sums' order differs from cuBLAS's, so the engine's `numerics`
carries `gemm=triton`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tidal.engine.generation import fused
from tidal.engine.tp import group_size


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM's tiling. `block_k` and `split_k` set the order of a row's sums (part of the numerics);
    `block_n`, `block_m`, `num_warps` and `num_stages` only tile the work."""

    block_n: int
    block_k: int
    split_k: int = 1
    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 4

    def k_per_split(self, k: int) -> int:
        """K columns each split sums (a whole number of `block_k` steps; the last split may hold fewer)."""
        steps = -(-k // self.block_k)
        return -(-steps // self.split_k) * self.block_k


@functools.cache
def _gemm_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(x_ptr, x_sm, w_ptr, w_sn, b_ptr, out_ptr, M, N, K, K_SPLIT, UP_OFFSET,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIALS: tl.constexpr,
             HAS_BIAS: tl.constexpr, SILU_UP: tl.constexpr, PDL: tl.constexpr):
        if PDL:   # the next kernel may start its programs now (they wait for this one before reading its output)
            tl.extra.cuda.gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < N
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        # the first K step's weight tiles before waiting for the previous kernel (weights: written by no kernel
        # of the step), then its x; the loop runs the remaining steps
        rk = k_lo + tl.arange(0, BLOCK_K)
        kmask = rk < k_hi
        w = tl.load(w_ptr + rn[:, None] * w_sn + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if SILU_UP:
            u = tl.load(w_ptr + (rn + UP_OFFSET)[:, None] * w_sn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + rm[:, None] * x_sm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w))
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if SILU_UP:
            acc_up = tl.dot(x, tl.trans(u))
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < k_hi
            x = tl.load(x_ptr + rm[:, None] * x_sm + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + rn[:, None] * w_sn + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
            if SILU_UP:
                u = tl.load(w_ptr + (rn + UP_OFFSET)[:, None] * w_sn + rk[None, :],
                            mask=nmask[:, None] & kmask[None, :], other=0.0)
                acc_up += tl.dot(x, tl.trans(u))
        omask = mmask[:, None] & nmask[None, :]
        if not PARTIALS:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            y = acc.to(out_ptr.dtype.element_ty)
            if SILU_UP:   # silu(gate) * up in fp32 from the rounded gate and up, rounded once
                g = y.to(tl.float32)
                up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
                y = (g * tl.sigmoid(g) * up).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], y, mask=omask)
        else:   # out is the fp32 partials [S, M, N]
            tl.store(out_ptr + (pid_k * M + rm)[:, None] * N + rn[None, :], acc, mask=omask)

    return gemm


@functools.cache
def _norm_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def reduce_add_rms_norm(part_ptr, x_ptr, w_ptr, x_out_ptr, h_out_ptr, M, N, eps, SPLIT,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cmask = cols < N
        total = tl.load(part_ptr + row * N + cols, mask=cmask, other=0.0)
        for s in range(1, SPLIT):   # in split order: a fixed sum
            total += tl.load(part_ptr + (s * M + row) * N + cols, mask=cmask, other=0.0)
        dtype = x_out_ptr.dtype.element_ty
        y = total.to(dtype).to(tl.float32)   # the GEMM's output, rounded as cuBLAS's would be
        x = tl.load(x_ptr + row * N + cols, mask=cmask, other=0.0).to(tl.float32)
        x = (x + y).to(dtype)
        tl.store(x_out_ptr + row * N + cols, x, mask=cmask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
        normed = (xf * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(h_out_ptr + row * N + cols, (w * normed).to(dtype), mask=cmask)

    return reduce_add_rms_norm


def supported(x: torch.Tensor) -> bool:
    """The kernels' inputs: bf16/fp16 on CUDA."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cfg: GemmConfig, n: int,
            silu_up: bool = False, partials: bool = False) -> torch.Tensor:
    if x.stride(-1) != 1 or w.stride(-1) != 1 or x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"decode_gemm: x [M, K] and w [N, K] with contiguous K, got {tuple(x.shape)} "
                         f"{tuple(w.shape)}")
    m, k = x.shape
    k_split = cfg.k_per_split(k)
    splits = -(-k // k_split)
    if not partials and splits > 1:
        raise ValueError(f"decode_gemm: a rounded output needs the whole K in one split ({cfg} splits K={k})")
    if partials:
        out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    gemm = _gemm_kernel()
    grid = (-(-n // cfg.block_n), splits, -(-m // cfg.block_m))
    gemm[grid](x, x.stride(0), w, w.stride(0), bias if bias is not None else w, out,
               m, n, k, k_split, n if silu_up else 0,
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PARTIALS=partials,
               HAS_BIAS=bias is not None, SILU_UP=silu_up, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
               **fused.pdl_launch(x.device))
    return out


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, cfg: GemmConfig) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias), rounded to x's dtype; `cfg` must sum K in one split."""
    return _launch(x, w, bias, cfg, w.shape[0])


def gate_up_silu(x: torch.Tensor, w_gate_up: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) [M, F] from the packed [2F, K] weight (gate rows first); `cfg` must sum
    K in one split."""
    return _launch(x, w_gate_up, None, cfg, w_gate_up.shape[0] // 2, silu_up=True)


def linear_partials(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """fp32 partial sums [S, M, N] of x @ w^T over `cfg`'s S K-splits (S >= 1), for `reduce_add_rms_norm`."""
    return _launch(x, w, None, cfg, w.shape[0], partials=True)


def reduce_add_rms_norm(partials: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + round(sum of partials), rms_norm of that sum scaled by `weight`), each [M, N] in x's dtype."""
    import triton

    s, m, n = partials.shape
    if x.shape != (m, n) or not x.is_contiguous() or not partials.is_contiguous():
        raise ValueError(f"reduce_add_rms_norm: partials [S, M, N] and x [M, N] contiguous, got "
                         f"{tuple(partials.shape)} {tuple(x.shape)}")
    x_out, h_out = torch.empty_like(x), torch.empty_like(x)
    kernel = _norm_kernel()
    block = triton.next_power_of_2(n)
    kernel[(m,)](partials, x, weight, x_out, h_out, m, n, eps, SPLIT=s, BLOCK=block,
                 num_warps=4 if block <= 4096 else 8, **fused.pdl_launch(x.device))
    return x_out, h_out


# ---- the tilings the engine runs --------------------------------------------------------------------------
#: most rows the engine runs on these kernels; larger decode buckets run cuBLAS (at 256 rows a GEMM is no longer
#: bound by its weight read alone, and cuBLAS's large tiles win)
MAX_ROWS = 64
#: programs a split-K GEMM aims at: splits beyond it write more partial sums than they save in latency
SPLIT_PROGRAMS = 96


def config_for(role: str, n: int, k: int) -> GemmConfig:
    """The tiling of one decode GEMM of the engine (`role`: qkv, o, gate_up, down; n the output columns, for
    gate_up the SiLU product's). A function of (role, n, k) alone: a row's sums never depend on the batch.
    The fastest of `benchmarks/decode_gemm.py`'s sweep at 64 rows on an H200 (Qwen2.5-1.5B's projections)."""
    if role == "qkv":   # one pass over K, the bias in the epilogue
        return GemmConfig(block_n=16, block_k=128, num_stages=5)
    if role == "gate_up":   # one pass over K, both weights' tiles, the SiLU product in the epilogue
        return GemmConfig(block_n=32, block_k=64, num_stages=3)
    if role in ("o", "down"):
        block_n = 32 if role == "o" else 64
        split = max(1, min(-(-k // 128), round(SPLIT_PROGRAMS / -(-n // block_n))))
        return GemmConfig(block_n=block_n, block_k=128, split_k=split, num_stages=5)
    raise ValueError(f"decode_gemm.config_for: unknown role {role!r}")


def usable(model) -> bool:
    """The model's decode step can run on these kernels: one TP rank, packed projections, bf16/fp16 on CUDA."""
    layer = model.layers[0]
    return group_size(model.tp_group) == 1 and layer.self_attn.packed is not None and layer.mlp.packed is not None \
        and supported(layer.mlp.packed)


def decode_hidden(model, ids_R: torch.Tensor, pos_R: torch.Tensor, decoder, kernels) -> torch.Tensor:
    """The last hidden state [R, 1, H] of one decode step of `model` (a `tidal.engine.model.Transformer` with
    packed projections, TP 1), on this module's kernels: the same math as `model.hidden` with the step's
    `decoder` (the fused decode attention, which applies RoPE) and `kernels` (the compiled elementwise stages,
    for the first norm and Qwen3's q/k norms). Each layer's residual add and the next norm are one launch."""
    layers = list(model.layers)
    attn0 = layers[0].self_attn
    heads, kv_heads, d = attn0.n_heads, attn0.n_kv, attn0.d
    x = model.embed_tokens(ids_R)   # [R, H]
    cos, sin = model.rope_cos[pos_R].to(x.dtype), model.rope_sin[pos_R].to(x.dtype)
    r, hidden = x.shape
    h = kernels.rms_norm(x, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        w_qkv, b_qkv = attn.packed
        qkv = linear(h, w_qkv, b_qkv, config_for("qkv", w_qkv.shape[0], hidden))
        q = qkv[:, :heads * d].view(r, heads, d)
        k = qkv[:, heads * d:(heads + kv_heads) * d].view(r, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d:].view(r, kv_heads, d)
        if attn.qk_norm:
            q, k = attn.q_norm(q, kernels), attn.k_norm(k, kernels)
        out = decoder.attend(i, q[:, :, None], k[:, :, None], v[:, :, None], cos[:, None], sin[:, None])
        out = out.reshape(r, heads * d)
        w_o = attn.o_proj.weight
        parts = linear_partials(out, w_o, config_for("o", w_o.shape[0], w_o.shape[1]))
        norm = layer.post_attention_layernorm
        x, h = reduce_add_rms_norm(parts, x, norm.weight, norm.eps)
        act = gate_up_silu(h, mlp.packed, config_for("gate_up", mlp.packed.shape[0] // 2, hidden))
        w_down = mlp.down_proj.weight
        parts = linear_partials(act, w_down, config_for("down", w_down.shape[0], w_down.shape[1]))
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        x, h = reduce_add_rms_norm(parts, x, norm.weight, norm.eps)
    return h[:, None]
