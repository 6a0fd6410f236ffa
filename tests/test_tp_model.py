"""TP forward/backward equal the single-process model on real gloo worlds (fp32 round-off), for the families'
parameter sets: Qwen2's q/k/v biases split with their heads, Qwen3's q/k norms replicated with their gradient
summed over the TP group (each rank normalizes only its heads)."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tidal.engine.model import ModelArgs, Transformer, init_global_weights, param_specs
from tidal.engine.testing import run_ranks

# vocab 23 splits unevenly over 2 and 4 ranks; 8 query heads over 4 kv heads exercises GQA.
ARGS = ModelArgs(vocab_size=23, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=4,
                 intermediate_size=48, max_seq_len=16)
FAMILIES = {"llama": ARGS, "qwen2": replace(ARGS, qkv_bias=True), "qwen3": replace(ARGS, qk_norm=True, head_dim=6)}


def _weights(args):
    """Random biases and norms (init gives zeros and ones), so a wrong shard or a missing gradient sum shows."""
    g = torch.Generator().manual_seed(5)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) if k.endswith(("bias", "norm.weight")) else v
            for k, v in init_global_weights(args, 0).items()}


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, ARGS.vocab_size, (3, 12), generator=g)


def _reference(args=ARGS):
    m = Transformer(args)
    m.load_global(_weights(args))
    ids = _batch()
    lp = m.token_logprobs(ids)
    (-lp.sum()).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def _tp_body(rank, world, tp, family="llama"):
    group = dist.new_group(list(range(world)))
    m = Transformer(FAMILIES[family], tp_group=group)
    m.load_global(_weights(FAMILIES[family]))
    lp = m.token_logprobs(_batch())
    (-lp.sum()).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("tp, family", [(2, "llama"), (4, "llama"), (2, "qwen2"), (4, "qwen3")])
def test_tp_forward_backward_match_single_process(tp, family):
    args = FAMILIES[family]
    ref_lp, ref_grads = _reference(args)
    specs = {s.name: s for s in param_specs(args)}
    results = run_ranks(tp, _tp_body, tp, family)
    for t, (lp, grads) in enumerate(results):
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            want = ref_grads[name][specs[name].tp_slices(tp, t)]
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name, t=t: f"{name} (tp rank {t}): {m}")


def test_tp_that_does_not_divide_heads_is_refused():
    from tidal.core.errors import LayoutError
    from tidal.engine.model import check_tp
    check_tp(ARGS, 4)
    with pytest.raises(LayoutError, match="num_kv_heads"):
        check_tp(ARGS, 8)


def _tp_entropy(rank, world):
    group = dist.new_group(list(range(world)))
    m = Transformer(ARGS, tp_group=group)
    m.load_global(_weights(ARGS))
    with torch.no_grad():
        return m.token_logprobs_entropy(_batch())[1]


def test_tp_entropy_matches_single_process():
    """The entropy's two vocab sums are reduced over the TP group: each rank holds the whole distribution's."""
    m = Transformer(ARGS)
    m.load_global(_weights(ARGS))
    with torch.no_grad():
        want = m.token_logprobs_entropy(_batch())[1]
    for got in run_ranks(2, _tp_entropy):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
