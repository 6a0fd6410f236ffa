"""Batched sampling with per-request randomness, and the rollout log-prob.

    tokens_N = sample(logits_NV, temperature_N, top_p_N, top_k_N, uniform_N)

Each row is sampled by inverse CDF from one uniform number `uniform_N[i]` that the engine draws from the
request's own `torch.Generator` (one draw per sampled token; greedy rows draw nothing). Drawing the uniforms
per request is the only per-request Python work of a decode step; everything else is batched tensor math
whose per-row result does not depend on the other rows. The distribution of row i is
`softmax(logits / temperature)`; with top-k or top-p it is restricted to the top-k tokens and then to the
smallest prefix (by descending probability, ties in vocab order via a stable sort) whose mass reaches top_p
(the first token is always kept), renormalized, and the inverse CDF runs over that sorted order. Without them
the inverse CDF runs in vocab order and nothing is sorted: a stable sort of 151,936 logits per row costs more
than a 1.5B model's whole decode forward on an H200. Temperature 0 is greedy: the argmax (lowest id on ties).

Rollout log-prob (what RL needs as the behaviour policy's log-prob): `logprobs(logits, tokens)` is
log softmax(logits)[token] at temperature 1, in fp32, *before* temperature, top-k or top-p. It is the same
quantity the actor computes with `Transformer.token_logprobs`, so rollout and actor log-probs agree up to
fp32 round-off for the same weights.
"""

from __future__ import annotations

import torch

#: vocab block of the two-level inverse CDF (`_inverse_cdf_blocked`)
SCAN_BLOCK = 128


def sample(logits_NV: torch.Tensor, temperature_N: torch.Tensor, top_p_N: torch.Tensor, top_k_N: torch.Tensor,
           uniform_N: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """One token per row (int64 [N]). All inputs on the logits' device; logits are used in fp32.

    `filtered`: some row may have top-k or top-p set (the caller knows its rows' params); False skips the
    vocab sort, which no row then needs. A row's token does not depend on it: rows without top-k/top-p take
    the unsorted inverse CDF either way."""
    logits = logits_NV.float()
    greedy = temperature_N <= 0
    temp = torch.where(greedy, torch.ones_like(temperature_N), temperature_N)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    sampled = _inverse_cdf_blocked(probs, uniform_N)
    if filtered:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        cum = sorted_p.cumsum(dim=-1)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        keep = (cum - sorted_p) < top_p_N[:, None]  # mass before this token has not reached top_p yet
        keep &= (top_k_N[:, None] <= 0) | (rank[None, :] < top_k_N[:, None])
        nucleus = order.gather(-1, _inverse_cdf((sorted_p * keep).cumsum(dim=-1), uniform_N)[:, None]).squeeze(-1)
        sampled = torch.where((top_p_N < 1) | (top_k_N > 0), nucleus, sampled)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _inverse_cdf(cum_NV: torch.Tensor, uniform_N: torch.Tensor) -> torch.Tensor:
    """The index whose cumulative mass first exceeds uniform x total, per row."""
    target = uniform_N * cum_NV[:, -1]
    return torch.searchsorted(cum_NV, target[:, None].contiguous(), right=True).clamp_max(cum_NV.shape[-1] - 1)[:, 0]


def _inverse_cdf_blocked(probs_NV: torch.Tensor, uniform_N: torch.Tensor) -> torch.Tensor:
    """`_inverse_cdf(probs.cumsum(-1), u)` in two levels: the vocab in blocks of SCAN_BLOCK, the block holding
    the target found from the running totals of the blocks' sums, then the token inside that block from its own
    running mass. Only [N, blocks] and [N, SCAN_BLOCK] are scanned: torch's scan of a 151,936-wide row costs
    more than the model's attention on an H200 (0.25 ms for 64 rows). The same function of (probs, u) on every
    device and batch; never a token of probability zero."""
    n, v = probs_NV.shape
    pad = -v % SCAN_BLOCK
    blocks = torch.nn.functional.pad(probs_NV, (0, pad)).view(n, -1, SCAN_BLOCK)   # [N, nb, B]
    totals = blocks.sum(dim=-1).cumsum(dim=-1)                                      # [N, nb]
    target = uniform_N * totals[:, -1]
    blk = torch.searchsorted(totals, target[:, None].contiguous(), right=True).clamp_max(totals.shape[-1] - 1)
    before = torch.where(blk > 0, totals.gather(-1, (blk - 1).clamp_min(0)), torch.zeros_like(target[:, None]))
    block = blocks.gather(1, blk[:, :, None].expand(n, 1, SCAN_BLOCK))[:, 0]       # [N, B]
    inside = _inverse_cdf_at(block.cumsum(dim=-1) + before, target)
    # a target within round-off of the block's end (its sum and its running mass round apart) takes the block's
    # last token of nonzero probability
    last = SCAN_BLOCK - 1 - (block > 0).flip(-1).int().argmax(dim=-1)
    return (blk[:, 0] * SCAN_BLOCK + torch.minimum(inside, last)).clamp_max(v - 1)


def _inverse_cdf_at(cum_NV: torch.Tensor, target_N: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(cum_NV.contiguous(), target_N[:, None].contiguous(), right=True
                              ).clamp_max(cum_NV.shape[-1] - 1)[:, 0]


def logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] at temperature 1, fp32 [N]."""
    return torch.log_softmax(logits_NV.float(), dim=-1).gather(-1, tokens_N[:, None]).squeeze(-1)
