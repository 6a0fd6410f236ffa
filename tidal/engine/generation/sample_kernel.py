"""The decode step's sampling and rollout log-prob in Triton (CUDA engines, rows without top-k/top-p).

`sampler.sample` + `sampler.logprobs` on a [64, 151,936] logits tensor launch about a dozen kernels (an fp32 copy
of the logits, two softmaxes, the block sums and scans, the argmax): about 0.24 ms of a 2.7 ms decode step of a
1.5B model on an H200, for 19 MB of logits. Here two launches read the bf16 logits about once:

    stage 1, grid (rows, vocab chunks of CHUNK ids): the chunk's max, its first id at the max, and its sums
        exp(l - max) and exp((l - max) / T)
    stage 2, grid (rows): the chunks combined in order (the row's max, argmax: lowest id on ties, the two sums);
        a sampled row then finds the chunk where the running mass of exp((l - max) / T) first exceeds u x the
        total, and inside it the first id where it does (a cumulative sum over the chunk)

and writes the token and log softmax(logits)[token] at temperature 1 (fp32). The same function as the torch
sampler for these rows (greedy: the argmax; sampled: the inverse CDF of softmax(logits / T) in vocab order; the
log-prob before temperature) up to fp32 round-off in the sums' order; never a token of probability zero (a
target past the row's running mass, by round-off, takes the last id of nonzero mass). A row's result depends on
its logits, T and u only: the chunks are fixed ids, combined in a fixed order.
"""

from __future__ import annotations

import functools

import torch

from tidal.engine.generation import fused

#: vocab ids per stage-1 program
CHUNK = 4096


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_stats(logits_ptr, l_sr, V, temp_ptr, stats_ptr, n_chunks, CHUNK_: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        c = tl.program_id(1)
        t = tl.load(temp_ptr + row).to(tl.float32)
        inv_t = 1.0 / tl.where(t <= 0.0, 1.0, t)
        ids = c * CHUNK_ + tl.arange(0, CHUNK_)
        lg = tl.load(logits_ptr + row.to(tl.int64) * l_sr + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        cm = tl.max(lg, 0)
        at = stats_ptr + (row * n_chunks + c) * 4
        tl.store(at, cm)
        tl.store(at + 1, tl.min(tl.where(lg == cm, ids, V), 0).to(tl.float32))   # exact below 2**24 ids
        tl.store(at + 2, tl.sum(tl.exp(lg - cm), 0))
        tl.store(at + 3, tl.sum(tl.exp((lg - cm) * inv_t), 0))

    @triton.jit
    def sample_logprob(logits_ptr, l_sr, V, temp_ptr, u_ptr, stats_ptr, n_chunks, tok_ptr, lp_ptr,
                       CHUNK_: tl.constexpr, MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * l_sr
        t = tl.load(temp_ptr + row).to(tl.float32)
        inv_t = 1.0 / tl.where(t <= 0.0, 1.0, t)
        cs = tl.arange(0, MAX_CHUNKS)
        valid = cs < n_chunks
        at = stats_ptr + (row * n_chunks + cs) * 4
        cm = tl.load(at, mask=valid, other=float("-inf"))
        m = tl.max(cm, 0)
        first = tl.min(tl.where(cm == m, cs, MAX_CHUNKS), 0)   # the lowest chunk at the max holds the argmax
        arg = tl.sum(tl.where(cs == first, tl.load(at + 1, mask=valid, other=0.0), 0.0), 0).to(tl.int32)
        s1 = tl.sum(tl.load(at + 2, mask=valid, other=0.0) * tl.exp(cm - m), 0)
        mass = tl.load(at + 3, mask=valid, other=0.0) * tl.exp((cm - m) * inv_t)   # each chunk's share
        tok = arg
        if t > 0.0:
            target = tl.load(u_ptr + row).to(tl.float32) * tl.sum(mass, 0)
            cum = tl.cumsum(mass, 0)
            last_c = tl.max(tl.where(mass > 0.0, cs, -1), 0)   # the last chunk of nonzero mass
            c = tl.minimum(tl.min(tl.where((cum > target) & (mass > 0.0), cs, MAX_CHUNKS), 0), last_c)
            before = tl.sum(tl.where(cs == c, cum - mass, 0.0), 0)
            ids = c * CHUNK_ + tl.arange(0, CHUNK_)
            lg = tl.load(base + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
            e = tl.exp((lg - m) * inv_t)
            over = ((tl.cumsum(e, 0) + before) > target) & (e > 0.0)
            tok = tl.minimum(tl.min(tl.where(over, ids, V), 0), tl.max(tl.where(e > 0.0, ids, -1), 0))
        lt = tl.load(base + tok).to(tl.float32)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, lt - m - tl.log(s1))

    return chunk_stats, sample_logprob


def sample_logprobs(logits_NV: torch.Tensor, temperature_N: torch.Tensor, uniform_N: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token int64 [N], rollout log-prob fp32 [N]) of rows without top-k/top-p (module doc). `logits_NV` may
    be a view with strided rows (a vocab limit's slice); bf16, fp16 or fp32."""
    import triton

    if logits_NV.stride(-1) != 1:
        raise ValueError("sample_logprobs: the logits need a contiguous vocab dim")
    n, v = logits_NV.shape
    chunks = triton.cdiv(v, CHUNK)
    stats = torch.empty((n, chunks, 4), dtype=torch.float32, device=logits_NV.device)
    tok = torch.empty(n, dtype=torch.int64, device=logits_NV.device)
    lp = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
    launch = fused.pdl_launch(logits_NV.device)
    chunk_stats, sample_logprob = _kernel()
    chunk_stats[(n, chunks)](logits_NV, logits_NV.stride(0), v, temperature_N, stats, chunks, CHUNK_=CHUNK,
                             num_warps=4, **launch)
    sample_logprob[(n,)](logits_NV, logits_NV.stride(0), v, temperature_N, uniform_N, stats, chunks, tok, lp,
                         CHUNK_=CHUNK, MAX_CHUNKS=max(2, triton.next_power_of_2(chunks)), num_warps=8,
                         **launch)
    return tok, lp
