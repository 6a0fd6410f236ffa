"""Native generation engine: exact per request (batch composition, slots, arrival), sampling, stops, weight
updates (rollout log-probs == actor log-probs), lifecycle, and clear errors."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tidal.core.errors import TidalError
from tidal.engine.generation import (
    EngineBusyError,
    EngineConfig,
    GenerationError,
    NativeEngine,
    Request,
    SamplingParams,
    UnknownRequestError,
    sampler,
)
from tidal.engine.generation.sampler import sample
from tidal.engine.generation.weights import actor_shards_from_global, rollout_shard
from tidal.engine.model import ModelArgs, Transformer, init_global_weights
from tidal.engine.testing import run_ranks

ARGS = ModelArgs(vocab_size=37, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 max_seq_len=32)
MIXED = [SamplingParams(0.0, max_new_tokens=9), SamplingParams(1.0, max_new_tokens=9, stop_token_ids=(3,)),
         SamplingParams(0.8, top_p=0.9, top_k=6, max_new_tokens=9), SamplingParams(1.3, top_p=0.7, max_new_tokens=9)]


def model(seed=0, args=ARGS):
    m = Transformer(args)
    m.load_global(init_global_weights(args, seed))
    return m


def requests(n, seed=0, params=MIXED):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 9, (1,), generator=g))
        prompt = tuple(torch.randint(0, ARGS.vocab_size, (length,), generator=g).tolist())
        out.append(Request(f"r{i}", prompt, params[i % len(params)], seed=1000 + i))
    return out


def run(engine, reqs, add_every=0):
    """Run to completion; with add_every=k, add one request every k steps (requests join mid-flight)."""
    pending, out, steps = list(reqs), {}, 0
    if not add_every:
        for r in pending:
            engine.add(r)
        pending = []
    while pending or engine.has_work():
        if pending and steps % add_every == 0:
            engine.add(pending.pop(0))
        for ev in engine.step():
            if ev.finished:
                assert ev.request_id not in out
                out[ev.request_id] = ev.result
        assert engine.num_running() <= engine.width
        steps += 1
    return out


def key(results):
    return {rid: (r.token_ids, r.logprobs, r.finish_reason) for rid, r in results.items()}


def test_batch_composition_does_not_change_tokens():
    m, reqs = model(), requests(10)
    together = key(run(NativeEngine(m, EngineConfig(max_running_requests=6)), reqs))
    reversed_ = key(run(NativeEngine(m, EngineConfig(max_running_requests=6)), reqs[::-1]))
    staggered = key(run(NativeEngine(m, EngineConfig(max_running_requests=6)), reqs, add_every=3))
    alone = {}
    for r in reqs:
        alone.update(key(run(NativeEngine(m, EngineConfig(max_running_requests=6)), [r])))
    assert together == reversed_ == staggered == alone  # token ids AND fp32 log-probs, bit for bit
    assert len({v[0] for v in together.values()}) > 7  # not degenerate


def test_compact_rows_compute_only_the_active_requests_and_generate_the_same():
    """Step-wide mode with compact rows: a step computes a power-of-two bucket of rows (at least 8) gathered from
    the active slots, not a row per slot. Requests joining and finishing at different steps cross buckets; every
    request's tokens and (up to fp32 round-off) log-probs equal those of an engine computing every slot."""
    lengths = [dataclasses.replace(MIXED[i % 4], max_new_tokens=2 + (5 * i) % 21) for i in range(40)]
    m, reqs = model(), requests(40, seed=3, params=lengths)
    base = EngineConfig(max_running_requests=32, batch_invariant=False)
    full = NativeEngine(m, base)
    compact = NativeEngine(m, dataclasses.replace(base, compact_rows=True))
    assert "compact=1" in compact.numerics and "compact=0" in full.numerics
    want = run(full, reqs)
    seen: list[int] = []
    launch = compact._launch

    def spy(inflight):
        out = launch(inflight)
        if out is not None:
            seen.append(len(out.tok))
        return out
    compact._launch = spy
    got = run(compact, reqs)
    assert set(seen) >= {8, 16, 32} and all(n in (8, 16, 32) for n in seen), sorted(set(seen))
    assert compact.keys_read < full.keys_read   # fewer rows read keys
    for rid, r in want.items():
        assert got[rid].token_ids == r.token_ids, rid
        assert max(abs(a - b) for a, b in zip(got[rid].logprobs, r.logprobs)) < 1e-5, rid
    with pytest.raises(TidalError, match="compact_rows"):
        NativeEngine(m, EngineConfig(max_running_requests=8, batch_invariant=True, compact_rows=True))


def test_the_triton_decode_gemms_are_refused_where_they_cannot_run_and_cublas_is_named():
    """`decode_gemm="triton"` needs the Triton decode attention (CUDA, TP 1, bf16/fp16): elsewhere the engine
    refuses it, naming the key and the way out; an unknown value is refused before any engine is built; the
    default on CPU runs torch's GEMMs and says so in its numerics."""
    m = model()
    with pytest.raises(TidalError, match='decode_gemm.*attention=sdpa.*use "cublas"'):
        NativeEngine(m, EngineConfig(max_running_requests=8, decode_gemm="triton"))
    with pytest.raises(TidalError, match="decode_gemm.*unknown kernel"):
        EngineConfig(decode_gemm="cutlass")  # type: ignore[arg-type]
    assert "gemm=cublas" in NativeEngine(m, EngineConfig(max_running_requests=8)).numerics


def test_same_seed_same_tokens_other_seed_other_tokens():
    m = model()
    p = SamplingParams(1.0, max_new_tokens=12)
    a = run(NativeEngine(m, EngineConfig(4)), [Request("a", (1, 2, 3), p, seed=5), Request("b", (1, 2, 3), p, seed=5),
                                              Request("c", (1, 2, 3), p, seed=6)])
    assert a["a"].token_ids == a["b"].token_ids != a["c"].token_ids


def test_logprobs_equal_actor_token_logprobs_after_weight_update():
    m = model(seed=0)
    engine = NativeEngine(m, EngineConfig(5), policy_version=0)
    new = init_global_weights(ARGS, 7)
    shard = rollout_shard(ARGS, actor_shards_from_global(ARGS, new, 2), rollout_tp=1, rollout_rank=0)
    engine.update_weights(shard, version=1)
    results = run(engine, requests(8))
    actor = model(seed=7)  # the actor's weights, single process
    for r in requests(8):
        res = results[r.request_id]
        assert res.policy_version == 1
        ids = torch.tensor([list(r.prompt_ids) + list(res.token_ids)])
        want = actor.token_logprobs(ids)[0, len(r.prompt_ids) - 1:].detach()
        torch.testing.assert_close(torch.tensor(res.logprobs), want, rtol=1e-5, atol=1e-5)


def test_stop_tokens_max_new_tokens_and_max_seq_len():
    m = model()
    greedy = run(NativeEngine(m, EngineConfig(2)), [Request("g", (1, 2), SamplingParams(0.0, max_new_tokens=6))])["g"]
    stop_at = greedy.token_ids[2]
    first = greedy.token_ids.index(stop_at)
    stopped = run(NativeEngine(m, EngineConfig(2)),
                  [Request("s", (1, 2), SamplingParams(0.0, max_new_tokens=6, stop_token_ids=(stop_at,)))])["s"]
    assert stopped.token_ids == greedy.token_ids[:first + 1] and stopped.finish_reason == "stop"
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 6
    long = run(NativeEngine(m, EngineConfig(2)),
               [Request("l", tuple(range(28)), SamplingParams(0.0, max_new_tokens=50))])
    assert len(long["l"].token_ids) == ARGS.max_seq_len - 28 and long["l"].finish_reason == "length"


def test_sampler_respects_top_k_top_p_and_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    top3 = set(logits[1].topk(3).indices.tolist())
    seen = set()
    for _ in range(200):
        u = torch.rand(4, generator=g)
        tok = sample(logits, torch.tensor([0.0, 1.0, 1.0, 5.0]), torch.tensor([1.0, 1.0, 1e-6, 1.0]),
                     torch.tensor([0, 3, 0, 0]), u)
        assert tok[0] == logits[0].argmax() and tok[2] == logits[2].argmax()
        assert tok[1].item() in top3
        seen.add(tok[3].item())
    assert len(seen) > 20  # high temperature spreads over the vocab


def test_the_blocked_inverse_cdf_draws_what_the_whole_row_scan_draws():
    """`sample` finds the token for uniform u in two levels (blocks of the vocab, then inside one): the same token
    as the inverse CDF over one whole-row cumulative sum, but where u falls within round-off of a boundary."""
    g = torch.Generator().manual_seed(1)
    for v in (7, 128, 1000, 4099):
        probs = torch.softmax(torch.randn(512, v, generator=g) * 4, dim=-1)
        probs[:, v // 3] = 0.0   # a token that can never be drawn
        u = torch.rand(512, generator=g)
        got = sampler._inverse_cdf_blocked(probs, u)
        want = sampler._inverse_cdf(probs.cumsum(dim=-1), u)
        assert (got == want).float().mean() > 0.995 and bool((probs.gather(1, got[:, None]) > 0).all())


def block_bytes(block=16, args=ARGS):
    return 2 * args.num_layers * args.num_kv_heads * block * args.head_dim * 4


def test_kv_budget_holds_blocks_and_admits_as_the_tokens_need_them():
    """A budget is a number of KV blocks (16 positions on CPU): requests hold ceil(positions / 16) of them, so
    a budget of 5 blocks runs more requests than it has max_seq_len slots (2 blocks each at max_seq_len 32)."""
    m, reqs = model(), requests(7)
    engine = NativeEngine(m, EngineConfig(max_running_requests=8, kv_budget_bytes=6 * block_bytes() + 5))
    assert engine.cache.num_blocks == 6 and engine.cache.nbytes == 6 * block_bytes()   # 5 + the null block
    for r in reqs:
        engine.add(r)
    engine.step()
    # prompts of 1..8 tokens + 9 new tokens fit one block (an 8-token prompt grows into a second one, and
    # admission keeps a free block for such a request); a max_seq_len slot cache of this size held 2 requests
    assert engine.num_running() == 5 and engine.num_waiting() == 2
    out = run(engine, [])  # `run` asserts num_running <= width at every step
    assert key(out) == key(run(NativeEngine(m, EngineConfig(max_running_requests=8)), reqs))
    assert engine.cache.free_blocks == 5
    with pytest.raises(TidalError, match="kv_budget_bytes.*one request at max_seq_len=32"):
        NativeEngine(m, EngineConfig(max_running_requests=8, kv_budget_bytes=3 * block_bytes() - 1))


def test_preempted_requests_finish_with_the_tokens_they_would_have_had():
    """Blocks too few for every running request's growth: the newest is preempted (blocks freed, re-prefilled
    and replayed later) and every request's tokens and log-probs equal an unlimited engine's, bit for bit."""
    args = dataclasses.replace(ARGS, max_seq_len=64)
    m = model(args=args)
    g = torch.Generator().manual_seed(3)
    params = [SamplingParams(1.0, max_new_tokens=40), SamplingParams(0.0, max_new_tokens=50),
              SamplingParams(0.9, top_k=9, max_new_tokens=45, stop_token_ids=(4,))]
    reqs = [Request(f"r{i}", tuple(torch.randint(0, args.vocab_size, (int(torch.randint(1, 12, (1,), generator=g)),),
                                                 generator=g).tolist()), params[i % 3], seed=70 + i)
            for i in range(9)]
    want = key(run(NativeEngine(m, EngineConfig(max_running_requests=6)), reqs))
    for overlap, add_every in ((False, 0), (False, 2), (True, 0), (True, 3)):
        tight = NativeEngine(m, EngineConfig(max_running_requests=6, kv_budget_bytes=7 * block_bytes(args=args),
                                             overlap=overlap))
        assert key(run(tight, reqs, add_every)) == want, (overlap, add_every)
        assert tight.preemptions > 0 and tight.cache.free_blocks == 6


def test_block_size_changes_no_bits_and_memory_follows_the_tokens():
    m, reqs = model(), requests(8)
    want = key(run(NativeEngine(m, EngineConfig(max_running_requests=4)), reqs))
    for block in (1, 5, 32):
        assert key(run(NativeEngine(m, EngineConfig(max_running_requests=4, kv_block_size=block)), reqs)) == want
    engine = NativeEngine(m, EngineConfig(max_running_requests=8, kv_block_size=4))
    greedy = requests(8, params=[SamplingParams(0.0, max_new_tokens=9)])
    for r in greedy:
        engine.add(r)
    engine.step()   # admitted and one decode step (at the prompt's length): blocks for prompt + 1 positions
    held = sum(engine.cache.held(s) for s in range(engine.width))
    assert engine.num_running() == 8 and held == sum(-(-(len(r.prompt_ids) + 1) // 4) for r in greedy)


def test_update_refused_while_busy_and_versions_only_increase():
    m = model()
    engine = NativeEngine(m, EngineConfig(2), policy_version=3)
    w = {n: p.detach().clone() for n, p in m.named_parameters()}
    engine.add(requests(1)[0])
    with pytest.raises(EngineBusyError, match="between RL steps"):
        engine.update_weights(w, 4)
    engine.abort(["r0"])
    with pytest.raises(TidalError, match="policy_version"):
        engine.update_weights(w, 3)
    bad = dict(w)
    bad["norm.weight"] = torch.ones(5)
    with pytest.raises(TidalError, match="norm.weight"):
        engine.update_weights(bad, 4)
    del bad["norm.weight"]
    with pytest.raises(TidalError, match="missing"):
        engine.update_weights(bad, 4)
    engine.update_weights(w, 4)
    assert engine.policy_version == 4


def test_release_memory_and_resume_give_the_same_tokens():
    m = model()
    engine = NativeEngine(m, EngineConfig(4))
    before = key(run(engine, requests(5)))
    engine.release_memory(offload=True)
    assert all(p.numel() == 0 for p in m.parameters()) and engine.cache.nbytes == 0
    with pytest.raises(GenerationError, match="resume"):
        engine.add(requests(1)[0])
    engine.resume()
    assert key(run(engine, requests(5))) == before
    engine.release_memory()
    with pytest.raises(GenerationError, match="offload"):
        engine.resume()
    engine.resume(init_global_weights(ARGS, 0), version=1)
    assert key(run(engine, requests(5))) == before and engine.policy_version == 1


def test_abort_and_export_of_unknown_or_finished_ids_are_clear_errors():
    m = model()
    engine = NativeEngine(m, EngineConfig(2))
    done = run(engine, [Request("x", (1, 2), SamplingParams(0.0, max_new_tokens=2))])
    assert "x" in done
    engine.add(Request("y", (1, 2), SamplingParams(0.0, max_new_tokens=5)))
    with pytest.raises(UnknownRequestError, match=r"'x' \(finished\).*'nope' \(never added here\)"):
        engine.abort(["x", "nope"])
    with pytest.raises(UnknownRequestError, match="finished"):
        engine.export_state(["x"])
    assert engine.request_ids() == ["y"]  # a failed call changes nothing
    engine.abort(["y"])
    with pytest.raises(UnknownRequestError, match="aborted"):
        engine.abort(["y"])
    with pytest.raises(GenerationError, match="already in flight"):
        engine.add(Request("z", (1,)))
        engine.add(Request("z", (2,)))


def test_bad_input_names_the_field():
    with pytest.raises(TidalError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(TidalError, match="temperature"):
        SamplingParams(temperature=-1)
    engine = NativeEngine(model(), EngineConfig(2))
    with pytest.raises(TidalError, match="max_seq_len"):
        engine.add(Request("p", tuple(range(ARGS.max_seq_len))))
    with pytest.raises(TidalError, match="vocab"):
        engine.add(Request("q", (1, 99)))


# ---- TP rollout engine on real gloo ranks ----------------------------------------------------------------
def _tp_body(rank, world):
    group = dist.new_group(list(range(world)))
    m = Transformer(ARGS, tp_group=group)
    m.load_global(init_global_weights(ARGS, 0))
    engine = NativeEngine(m, EngineConfig(4))
    actor = actor_shards_from_global(ARGS, init_global_weights(ARGS, 9), 4)  # actor at TP 4, rollout at TP 2
    engine.update_weights(rollout_shard(ARGS, actor, world, rank), version=2)
    return {rid: (r.token_ids, r.logprobs, r.policy_version) for rid, r in run(engine, requests(6)).items()}


def test_tp2_rollout_from_tp4_actor_matches_actor_logprobs():
    results = run_ranks(2, _tp_body)
    assert results[0] == results[1]  # TP ranks sample identically (replicated generators, gathered logits)
    actor = model(seed=9)
    for r in requests(6):
        toks, lps, version = results[0][r.request_id]
        assert version == 2
        want = actor.token_logprobs(torch.tensor([list(r.prompt_ids) + list(toks)]))[0, len(r.prompt_ids) - 1:]
        torch.testing.assert_close(torch.tensor(lps), want.detach(), rtol=1e-5, atol=1e-5)


def test_vocab_limit_never_emits_padding_rows():
    """An embedding padded past the tokenizer (Qwen: 151,936 rows, 151,665 tokens): with `vocab_limit` the engine
    samples and argmaxes only below it, even where a padding row has the largest logit."""
    m = model()
    with torch.no_grad():   # make the padding rows the most likely tokens everywhere
        m.lm_head.weight[20:] = m.lm_head.weight[:17] * 50
    reqs = requests(12)
    free = run(NativeEngine(m, EngineConfig(max_running_requests=4)), reqs)
    assert any(t >= 20 for r in free.values() for t in r.token_ids)   # without the limit they are emitted
    limited = run(NativeEngine(m, EngineConfig(max_running_requests=4, vocab_limit=20)), reqs)
    assert all(t < 20 for r in limited.values() for t in r.token_ids)
    with pytest.raises(TidalError, match="vocab_limit"):
        NativeEngine(m, EngineConfig(vocab_limit=ARGS.vocab_size + 1))
