"""The actor's memory paths: log-probs without the whole [B, T, V] logits, activation checkpointing, and the
compute dtype the actor and the engines share."""

import pytest
import torch

import tidal.engine.model as model_mod
from tidal.engine.actor import ActorShard, SharedQueue, nll_loss
from tidal.engine.layout import Layout
from tidal.engine.model import ModelArgs, Transformer, compute_dtype, init_global_weights
from tidal.engine.optim import OptimConfig
from tidal.engine.testing import run_ranks

ARGS = ModelArgs(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                 max_seq_len=24)


def _model(args=ARGS) -> Transformer:
    m = Transformer(args)
    m.load_global(init_global_weights(args, 0))
    return m


def test_chunked_logprobs_equal_the_whole_logits_and_their_gradients(monkeypatch):
    """Chunks of 64 rows (8 x 23 positions = 184 rows: 3 chunks, the last short) against one pass over the whole
    logits: values and input-embedding gradients agree to fp32 round-off (the head's GEMM has other row counts)."""
    ids = torch.randint(0, ARGS.vocab_size, (8, 24), generator=torch.Generator().manual_seed(0))
    whole, chunked = _model(), _model()
    ref = whole.token_logprobs(ids)
    ref.sum().backward()
    monkeypatch.setattr(model_mod, "LOGPROB_CHUNK_ELEMENTS", 64 * ARGS.vocab_size)
    got = chunked.token_logprobs(ids)
    got.sum().backward()
    assert got.shape == ref.shape == (8, 23) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
    for (name, a), b in zip(whole.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():   # inference: chunked the same way, nothing kept for a backward
        torch.testing.assert_close(chunked.token_logprobs(ids), got.detach(), rtol=0, atol=0)


def test_entropy_comes_with_the_logprobs_whole_or_in_chunks(monkeypatch):
    """The policy's entropy per position from the same (chunked) logits: equal to -sum p log p of the whole
    softmax, without grad, and leaving the log-probs exactly as `token_logprobs` gives them."""
    ids = torch.randint(0, ARGS.vocab_size, (8, 24), generator=torch.Generator().manual_seed(2))
    m = _model()
    with torch.no_grad():
        logp = torch.log_softmax(m(ids)[:, :-1].double(), dim=-1)
        want = -(logp.exp() * logp).sum(-1).float()
        lp, ent = m.token_logprobs_entropy(ids)
        torch.testing.assert_close(ent, want, rtol=0, atol=2e-5)
        assert torch.equal(lp, m.token_logprobs(ids))
        monkeypatch.setattr(model_mod, "LOGPROB_CHUNK_ELEMENTS", 64 * ARGS.vocab_size)
        _, ent_c = m.token_logprobs_entropy(ids)
        torch.testing.assert_close(ent_c, want, rtol=0, atol=2e-5)
    lp_g, ent_g = m.token_logprobs_entropy(ids)   # with grad: the entropy is a metric, never in the graph
    assert lp_g.requires_grad and not ent_g.requires_grad


def _train_rank(rank: int, world: int, checkpointing: bool) -> dict:
    shard = ActorShard(ARGS, OptimConfig(lr=1e-2, warmup_iters=0, total_iters=10),
                       Layout(1, world, tuple(range(world))), rank, weights=init_global_weights(ARGS, 0),
                       activation_checkpointing=checkpointing)
    ids = torch.randint(0, ARGS.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        shard.train_iter(SharedQueue([ids[i:i + 2] for i in range(0, 8, 2)]), lambda m, b, t: nll_loss(m, b, t), 120)
    return {k: v.reshape(-1) for k, v in shard.local_tensors().items()}


def test_activation_checkpointing_trains_bit_for_bit_like_without():
    """DP 2, two iters: recomputing each layer in the backward changes no bit of the parameters or moments."""
    plain, recomputed = run_ranks(2, _train_rank, False), run_ranks(2, _train_rank, True)
    for a, b in zip(plain, recomputed):
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_compute_dtype_is_the_configs_and_auto_follows_the_device():
    assert compute_dtype("auto", "cpu") is torch.float32
    assert compute_dtype("auto", "cuda") is torch.bfloat16
    assert compute_dtype("bfloat16", "cpu") is torch.bfloat16
    assert compute_dtype("float32", "cuda") is torch.float32


def test_an_engine_in_bf16_generates_from_weights_in_bf16():
    """The engines take the actor's compute dtype: a bf16 model's engine holds a bf16 KV cache and generates."""
    from tidal.engine.generation import EngineConfig, NativeEngine, Request, SamplingParams
    m = Transformer(ARGS, dtype=torch.bfloat16)
    m.load_global(init_global_weights(ARGS, 0))
    engine = NativeEngine(m.eval(), EngineConfig(max_running_requests=4))
    assert engine.cache.k[0].dtype is torch.bfloat16
    engine.add(Request("r0", (1, 2, 3), SamplingParams(max_new_tokens=5, temperature=0.0), seed=0))
    results = []
    for _ in range(20):
        results += [e.result for e in engine.step() if e.result is not None]
    assert len(results) == 1 and len(results[0].token_ids) == 5 and engine.num_running() == 0


def test_an_engine_freed_of_its_kv_cache_keeps_the_model_for_scoring_then_frees_it_too():
    """`rollout_free_kv`, then `rollout_release`, on one engine: the scorer reads the kept weights between."""
    from tidal.engine.generation import EngineConfig, NativeEngine
    m = _model().eval()
    engine = NativeEngine(m, EngineConfig(max_running_requests=4))
    ids = torch.randint(0, ARGS.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m.token_logprobs(ids)
        engine.release_memory(keep_weights=True)
        assert engine.cache.nbytes == 0
        assert torch.equal(m.token_logprobs(ids), want)
        engine.release_memory()
    assert all(p.numel() == 0 for p in m.parameters())
    engine.resume(weights=init_global_weights(ARGS, 0), version=1)
    with torch.no_grad():
        assert torch.equal(m.token_logprobs(ids), want) and engine.cache.nbytes > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_run_spec_carries_actor_dtype_to_the_workers(dtype):
    from tidal.core.config import build_config
    from tidal.pipeline.inputs import read_inputs
    from tidal.pipeline.run import run_spec
    cfg = build_config({"actor": {"dtype": dtype, "activation_checkpointing": True}, "warm_start": {"iters": 0}})
    spec = run_spec(cfg, read_inputs(cfg))
    assert spec.dtype == dtype and spec.activation_checkpointing
    assert compute_dtype(spec.dtype, "cpu") is getattr(torch, dtype)
