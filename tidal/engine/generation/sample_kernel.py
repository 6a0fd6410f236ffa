"""The decode step's sampling and rollout log-prob in one Triton kernel (CUDA engines, rows without top-k/top-p).

`sampler.sample` + `sampler.logprobs` on a [64, 151,936] logits tensor launch about a dozen kernels (an fp32 copy
of the logits, two softmaxes, the block sums and scans, the argmax): about 0.24 ms of a 2.7 ms decode step of a
1.5B model on an H200, for 19 MB of logits. Here one program per row reads its bf16 logits twice:

    pass 1 (every row): the max, the argmax (lowest id on ties), sum exp(l - max) and sum exp((l - max) / T)
    pass 2 (sampled rows): the inverse CDF in vocab order: the first id whose running mass of exp((l - max) / T)
        exceeds u x the total; blocks of BLOCK ids, the running mass carried from block to block, inside the
        block a cumulative sum

and writes the token and log softmax(logits)[token] at temperature 1 (fp32). The same function as the torch
sampler for these rows (greedy: the argmax; sampled: the inverse CDF of softmax(logits / T) in vocab order; the
log-prob before temperature) up to fp32 round-off in the sums' order; never a token of probability zero (a
target past the last block's running mass, by round-off, takes the last id of nonzero mass). A row's result
depends on its logits, T and u only.
"""

from __future__ import annotations

import functools

import torch

from tidal.engine.generation import fused

#: vocab ids per block of either pass
BLOCK = 2048


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sample_logprob(logits_ptr, l_sr, V, temp_ptr, u_ptr, tok_ptr, lp_ptr, BLOCK_: tl.constexpr,
                       PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * l_sr
        t = tl.load(temp_ptr + row).to(tl.float32)
        greedy = t <= 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / t)
        cols = tl.arange(0, BLOCK_)
        # pass 1: running max with rescaled sums (at temperature 1 and at T), argmax of the first maximum
        m = tl.full([], float("-inf"), tl.float32)
        s1 = tl.zeros([], tl.float32)
        st = tl.zeros([], tl.float32)
        arg = tl.zeros([], tl.int32)
        for v0 in range(0, V, BLOCK_):
            ids = v0 + cols
            lg = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
            bm = tl.max(lg, 0)
            barg = tl.min(tl.where(lg == bm, ids, V), 0)   # the block's first id at its max
            m_new = tl.maximum(m, bm)
            arg = tl.where(bm > m, barg, arg)              # strictly greater: an earlier block keeps a tie
            s1 = s1 * tl.exp(m - m_new) + tl.sum(tl.exp(lg - m_new), 0)
            st = st * tl.exp((m - m_new) * inv_t) + tl.sum(tl.exp((lg - m_new) * inv_t), 0)
            m = m_new
        tok = arg
        if not greedy:
            target = tl.load(u_ptr + row).to(tl.float32) * st
            run = tl.zeros([], tl.float32)
            found = tl.zeros([], tl.int32)
            last = tl.zeros([], tl.int32)
            for v0 in range(0, V, BLOCK_):
                if found == 0:
                    ids = v0 + cols
                    lg = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
                    e = tl.exp((lg - m) * inv_t)
                    cum = tl.cumsum(e, 0) + run
                    over = (cum > target) & (e > 0.0)
                    first = tl.min(tl.where(over, ids, V), 0)
                    nz = tl.max(tl.where(e > 0.0, ids, -1), 0)
                    last = tl.where(nz >= 0, nz, last)
                    found = tl.where(first < V, 1, 0)
                    tok = tl.where(first < V, first, tok)
                    run = run + tl.sum(e, 0)
            tok = tl.where(found == 1, tok, last)
        lt = tl.load(base + tok).to(tl.float32)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, lt - m - tl.log(s1))

    return sample_logprob


def sample_logprobs(logits_NV: torch.Tensor, temperature_N: torch.Tensor, uniform_N: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token int64 [N], rollout log-prob fp32 [N]) of rows without top-k/top-p (module doc). `logits_NV` may
    be a view with strided rows (a vocab limit's slice); bf16, fp16 or fp32."""
    if logits_NV.stride(-1) != 1:
        raise ValueError("sample_logprobs: the logits need a contiguous vocab dim")
    n, v = logits_NV.shape
    tok = torch.empty(n, dtype=torch.int64, device=logits_NV.device)
    lp = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
    pdl = fused.pdl(logits_NV.device)
    _kernel()[(n,)](logits_NV, logits_NV.stride(0), v, temperature_N, uniform_N, tok, lp, BLOCK_=BLOCK, PDL=pdl,
                    num_warps=8, **({"launch_pdl": True} if pdl else {}))
    return tok, lp
