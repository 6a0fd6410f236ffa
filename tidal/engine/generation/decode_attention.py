"""Decode attention for the CUDA engine in Triton: split-K over fixed key chunks, the new K/V written in the same
launch, each row reading only its own valid keys.

One decode step asks, per row r and query head h, for softmax(q K^T / sqrt(D)) V over the keys 0..pos[r] of the
row's slot, where key pos[r] is the row's own new K/V (not yet in the cache). SDPA over a step-wide span reads
every row's keys up to the longest row and, on an H200, spends 2.3x the time of its KV read on 6-query GQA groups
(its 64-query tiles are mostly padding). Here:

    stage 1, grid (rows, kv heads, chunks):  the G query heads of one kv head against one CHUNK of keys
        (an online softmax over BLOCK_N-key blocks, one tensor-core dot per block with the G heads padded to 16
        rows); writes the chunk's normalized output and its log-sum-exp. The program whose chunk holds pos[r]
        stores the new K/V into the cache and uses it from registers for that key (no read-after-write).
        Chunks past a row's length exit at once: a row reads its own keys, not the step's span.
    stage 2, grid (rows, heads):  the row's chunks combined in order 0, 1, ... (a sequential loop).

The cache is paged (`kv_cache.PagedKVCache`): each 64-key load looks its block up in the slot's row of the
block table; a block holds a whole number of loads, so the sums are those of one contiguous slot.

With `cos`/`sin` (the rows' RoPE tables at their positions, in the compute dtype) stage 1 also applies RoPE to
q and the new K as it loads them (x * cos + rotate_half(x) * sin in fp32, rounded once to the input dtype: the
math of the compiled `rope_qk`), which saves the step one launch per layer; q, K and V may then be strided views
of the packed q/k/v projection.

Invariant (what makes the kernel safe for a step-wide CUDA graph): a row's output depends only on its q, its
slot's keys 0..pos and pos itself, never on the step's span, the other rows, or the grid size: the chunk
boundaries are fixed multiples of CHUNK and the combine order is fixed. The math is attention in fp32
accumulation over bf16/fp16 inputs, rounding differently from SDPA's kernels, so it is part of the engine's
`fused=1` numerics (`tidal.engine.generation.fused`).
"""

from __future__ import annotations

import functools

import torch

from tidal.engine.generation import fused

#: keys per stage-1 program (fixed: a row's chunk boundaries, hence its result, never depend on the step)
CHUNK = 256
#: keys per online-softmax block inside a chunk
BLOCK_N = 64
#: stage 1's launch: warps per program, software-pipeline stages of the key loop
NUM_WARPS = 2
NUM_STAGES = 1


def supported(head_dim: int, dtype: torch.dtype) -> bool:
    """The kernel's shapes: a power-of-two head dim of 16..256, bf16 or fp16 K/V."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and dtype in (torch.bfloat16, torch.float16)


@functools.cache
def _block_steps():
    """Stage 1's steps over one block of keys (Triton inlines them into the kernel)."""
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_block(q, k, v, k_new, v_new, own, nmask, qk_scale, m_i, l_i, acc):
        # one BLOCK_N-key block of the online softmax: the row's own key from registers, the G heads' scores
        # (log2 domain) masked past the row's keys, folded into the running max, sum and output
        k = tl.where(own[:, None], k_new[None, :], k)
        v = tl.where(own[:, None], v_new[None, :], v)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def load_block(kc_ptr, vc_ptr, table, n0, end, pos, kvh, offs_d, c_sb, c_sh, c_sp, KV_BLOCK: tl.constexpr,
                   BLOCK_N_: tl.constexpr):
        # the cached K/V of keys n0 .. n0 + BLOCK_N (the row's own key and those past its length masked to 0), and
        # the masks; a load of BLOCK_N keys lies in one KV block (KV_BLOCK is a multiple of BLOCK_N, or one block)
        offs_n = n0 + tl.arange(0, BLOCK_N_)
        nmask = offs_n < end
        own = offs_n == pos   # the row's own key: masked here, written by the program whose chunk holds it
        j = n0 // KV_BLOCK
        block = tl.load(table + j).to(tl.int64)
        at = block * c_sb + kvh * c_sh + (offs_n - j * KV_BLOCK)[:, None] * c_sp + offs_d[None, :]
        k = tl.load(kc_ptr + at, mask=(nmask & ~own)[:, None], other=0.0)
        v = tl.load(vc_ptr + at, mask=(nmask & ~own)[:, None], other=0.0)
        return k, v, nmask, own

    @triton.jit
    def rope(q, k_new, q_ptr, kn_ptr, cos_ptr, sin_ptr, row, q_sr, q_sh, kn_sr, kn_sh, cs_sr, kvh, heads, gmask,
             offs_d, D: tl.constexpr):
        # q and the new K rotated: x * cos + rotate_half(x) * sin in fp32, rounded once to the input dtype;
        # rotate_half(x)[d] = -x[d + D/2] below D/2, x[d - D/2] above
        partner = (offs_d + D // 2) % D
        sign = tl.where(offs_d < D // 2, -1.0, 1.0)
        cs = tl.load(cos_ptr + row * cs_sr + offs_d).to(tl.float32)
        sn = tl.load(sin_ptr + row * cs_sr + offs_d).to(tl.float32) * sign
        q_p = tl.load(q_ptr + row * q_sr + heads[:, None] * q_sh + partner[None, :], mask=gmask[:, None], other=0.0)
        q = (q.to(tl.float32) * cs[None, :] + q_p.to(tl.float32) * sn[None, :]).to(q_p.dtype)
        k_p = tl.load(kn_ptr + row * kn_sr + kvh * kn_sh + partner)
        k_new = (k_new.to(tl.float32) * cs + k_p.to(tl.float32) * sn).to(k_p.dtype)
        return q, k_new

    return softmax_block, load_block, rope


@functools.cache
def _stage1():
    import triton
    import triton.language as tl
    softmax_block, load_block, rope = _block_steps()

    @triton.jit
    def stage1(q_ptr, q_sr, q_sh, kn_ptr, kn_sr, kn_sh, vn_ptr, vn_sr, vn_sh, kc_ptr, vc_ptr, c_sb, c_sh, c_sp,
               table_ptr, t_ss, slot_ptr, pos_ptr, mid_o_ptr, mid_lse_ptr, max_chunks, sm_scale, cos_ptr, sin_ptr,
               cs_sr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, CHUNK_: tl.constexpr,
               BLOCK_N_: tl.constexpr, KV_BLOCK: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr):
        if PDL:   # programmatic dependent launch (`fused.pdl`): the next kernel may start its programs
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        c = tl.program_id(2)
        # pos, slot and the block table are the step's inputs and the cached keys were written by earlier steps:
        # none is written by the kernels this one may overlap, so they and the chunk's first key block are read
        # before waiting for the previous kernel (whose q/k/v this program needs next)
        pos = tl.load(pos_ptr + row).to(tl.int32)   # loop bounds and offsets in one integer type
        start = c * CHUNK_
        if start <= pos:
            slot = tl.load(slot_ptr + row).to(tl.int64)
            offs_d = tl.arange(0, D)
            table = table_ptr + slot * t_ss   # the slot's row of the block table
            end = tl.minimum(start + CHUNK_, pos + 1)
            k_first, v_first, nmask, own = load_block(kc_ptr, vc_ptr, table, start, end, pos, kvh, offs_d, c_sb,
                                                      c_sh, c_sp, KV_BLOCK, BLOCK_N_)
            if PDL:
                tl.extra.cuda.gdc_wait()
            offs_g = tl.arange(0, BLOCK_G)
            gmask = offs_g < G
            heads = kvh * G + offs_g
            q = tl.load(q_ptr + row * q_sr + heads[:, None] * q_sh + offs_d[None, :], mask=gmask[:, None],
                        other=0.0)
            k_new = tl.load(kn_ptr + row * kn_sr + kvh * kn_sh + offs_d)
            v_new = tl.load(vn_ptr + row * vn_sr + vn_sh * kvh + offs_d)
            if ROPE:
                q, k_new = rope(q, k_new, q_ptr, kn_ptr, cos_ptr, sin_ptr, row, q_sr, q_sh, kn_sr, kn_sh, cs_sr, kvh,
                                heads, gmask, offs_d, D)
            if pos < start + CHUNK_:   # this chunk holds the row's own key: store it for later steps
                own_block = tl.load(table + pos // KV_BLOCK).to(tl.int64)
                at_own = own_block * c_sb + kvh * c_sh + (pos - (pos // KV_BLOCK) * KV_BLOCK) * c_sp + offs_d
                tl.store(kc_ptr + at_own, k_new)
                tl.store(vc_ptr + at_own, v_new)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, D], tl.float32)
            qk_scale = sm_scale * 1.4426950408889634   # exp(x) = exp2(x * log2(e))
            # the first block (read before the wait), then the chunk's other blocks: the same steps in order
            m_i, l_i, acc = softmax_block(q, k_first, v_first, k_new, v_new, own, nmask, qk_scale, m_i, l_i, acc)
            for n0 in range(start + BLOCK_N_, end, BLOCK_N_):
                k, v, nmask, own = load_block(kc_ptr, vc_ptr, table, n0, end, pos, kvh, offs_d, c_sb, c_sh, c_sp,
                                              KV_BLOCK, BLOCK_N_)
                m_i, l_i, acc = softmax_block(q, k, v, k_new, v_new, own, nmask, qk_scale, m_i, l_i, acc)
            at_mid = (row * (G * tl.num_programs(1)) + heads) * max_chunks + c
            tl.store(mid_o_ptr + at_mid[:, None] * D + offs_d[None, :], acc / l_i[:, None], mask=gmask[:, None])
            tl.store(mid_lse_ptr + at_mid, m_i + tl.log2(l_i), mask=gmask)   # log2-sum-exp2 of scaled scores

    return stage1


@functools.cache
def _stage2():
    import triton
    import triton.language as tl

    @triton.jit
    def stage2(mid_o_ptr, mid_lse_ptr, pos_ptr, out_ptr, o_sr, o_sh, max_chunks, num_heads,
               D: tl.constexpr, CHUNK_: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + row).to(tl.int32)
        n = (pos + CHUNK_) // CHUNK_   # chunks holding keys 0..pos
        offs_d = tl.arange(0, D)
        base = (row * num_heads + h) * max_chunks
        m = tl.load(mid_lse_ptr + base)
        acc = tl.load(mid_o_ptr + base * D + offs_d)
        total = m * 0.0 + 1.0   # an fp32 tensor like the values the loop assigns it
        for c in range(1, n):
            lse = tl.load(mid_lse_ptr + base + c)
            o = tl.load(mid_o_ptr + (base + c) * D + offs_d)
            m_new = tl.maximum(m, lse)
            a = tl.exp2(m - m_new)
            b = tl.exp2(lse - m_new)
            acc = acc * a + o * b
            total = total * a + b
            m = m_new
        tl.store(out_ptr + row * o_sr + h * o_sh + offs_d, (acc / total).to(out_ptr.dtype.element_ty))

    return stage2


def decode_attention_fused(q_RHD: torch.Tensor, k_new_RKD: torch.Tensor, v_new_RKD: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slots_R: torch.Tensor, pos_R: torch.Tensor,
                           span: int, cos_RD: torch.Tensor | None = None, sin_RD: torch.Tensor | None = None, *,
                           block_table: torch.Tensor | None = None, chunk: int = CHUNK, block_n: int = BLOCK_N,
                           num_warps: int = NUM_WARPS,
                           num_stages: int = NUM_STAGES) -> torch.Tensor:
    """out [R, H, D] of one decode step; also writes each row's new K/V at position pos of its slot.
    `block_table` [slots, blocks per slot] (int32): the caches are pools of KV blocks [N, K, B, D] (contiguous;
    B a multiple of `block_n`) and position p of a slot lives in block `table[slot, p // B]` at p % B (the
    paged cache of `kv_cache`); None: the caches are one contiguous block per slot ([W, K, S, D]).
    `span` only sizes the grid (>= every row's pos + 1). `cos_RD`/`sin_RD`: RoPE
    applied to q and the new K here (module doc); None: they arrive rotated. The keyword arguments are the
    launch's tuning knobs (`benchmarks/decode_attention.py` sweeps them); `chunk` and `block_n` are part of the
    numerics (they set the order of the sums), the warps and stages are not."""
    import triton

    r, h, d = q_RHD.shape
    kv = k_new_RKD.shape[1]
    if q_RHD.stride(-1) != 1 or k_new_RKD.stride(-1) != 1 or v_new_RKD.stride(-1) != 1:
        raise ValueError("decode_attention_fused: q and the new K/V need a contiguous head dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention_fused: the KV caches must be contiguous")
    if cos_RD is not None and sin_RD is not None:
        if cos_RD.shape != (r, d) or sin_RD.shape != (r, d) or cos_RD.stride() != sin_RD.stride() \
                or cos_RD.stride(-1) != 1:
            raise ValueError("decode_attention_fused: cos/sin are [rows, head_dim] with a contiguous head dim")
        rope, cs, sn, cs_sr = True, cos_RD, sin_RD, cos_RD.stride(0)
    elif cos_RD is None and sin_RD is None:
        rope, cs, sn, cs_sr = False, q_RHD, q_RHD, 0   # unread pointers
    else:
        raise ValueError("decode_attention_fused: RoPE takes both cos and sin")
    if block_table is None:   # one block per slot: the identity table
        block_table = torch.arange(k_cache.shape[0], dtype=torch.int32, device=k_cache.device)[:, None]
    elif block_table.shape[1] > 1 and k_cache.shape[2] % block_n:
        raise ValueError(f"decode_attention_fused: KV blocks of {k_cache.shape[2]} positions are not a multiple "
                         f"of the {block_n}-key loads")
    g = h // kv
    max_chunks = triton.cdiv(span, chunk)
    mid_o = torch.empty((r, h, max_chunks, d), dtype=torch.float32, device=q_RHD.device)
    mid_lse = torch.empty((r, h, max_chunks), dtype=torch.float32, device=q_RHD.device)
    out = torch.empty((r, h, d), dtype=q_RHD.dtype, device=q_RHD.device)
    stage1, stage2 = _stage1(), _stage2()
    launch = fused.pdl_launch(q_RHD.device)
    stage1[(r, kv, max_chunks)](
        q_RHD, q_RHD.stride(0), q_RHD.stride(1), k_new_RKD, k_new_RKD.stride(0), k_new_RKD.stride(1),
        v_new_RKD, v_new_RKD.stride(0), v_new_RKD.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table, block_table.stride(0), slots_R, pos_R, mid_o, mid_lse, max_chunks, 1.0 / d ** 0.5,
        cs, sn, cs_sr,
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, CHUNK_=chunk, BLOCK_N_=block_n,
        KV_BLOCK=k_cache.shape[2], ROPE=rope,
        num_warps=num_warps, num_stages=num_stages, **launch)
    stage2[(r, h)](mid_o, mid_lse, pos_R, out, out.stride(0), out.stride(1), max_chunks, h, D=d, CHUNK_=chunk,
                   num_warps=1, **launch)
    return out
