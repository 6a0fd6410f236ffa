"""The generation engine's step-wide mode on CUDA (bf16, CUDA graphs, batched prefill): what holds there.

- A decode row's tokens and log-probs do not depend on the key span of the step it runs in: keys past its
  position are masked, and a longer neighbour (a larger span, another captured graph) changes no bit.
- KV migration between engines of equal numerics continues a request bit for bit.
- A batched prefill equals one-at-a-time prefill up to bf16 round-off (compared, not asserted bit for bit).
- The Triton decode attention equals fp32 attention up to bf16 round-off, writes each row's new K/V, and a row's
  output bits depend neither on the step's span nor on the other rows.

Skipped without a GPU (CI has none); run on one with `python -m pytest tests/test_generation_cuda.py`."""

import pytest
import torch

from tidal.engine.generation import EngineConfig, NativeEngine, Request, SamplingParams
from tidal.engine.generation.decode_attention import decode_attention_fused
from tidal.engine.model import ModelArgs, Transformer, init_global_weights, rope_tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ARGS = ModelArgs(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=512,
                 max_seq_len=1024)
GREEDY = SamplingParams(0.0, max_new_tokens=48)
SAMPLED = SamplingParams(1.0, max_new_tokens=48)


def _model():
    m = Transformer(ARGS, dtype=torch.bfloat16, device="cuda")
    m.load_global(init_global_weights(ARGS, 0))
    return m


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, ARGS.vocab_size, (n,), generator=g).tolist())


def _finish(engine, out=None):
    out = {} if out is None else out
    while engine.has_work():
        for ev in engine.step():
            if ev.finished:
                out[ev.request_id] = ev.result
    return out


@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_row_does_not_depend_on_the_span_of_its_step(params, attention):
    m = _model()
    cfg = EngineConfig(max_running_requests=4, batch_invariant=False, decode_attention=attention)
    alone = NativeEngine(m, cfg)
    alone.add(Request("x", _prompt(20, 1), params, seed=7))
    want = _finish(alone)["x"]
    shared = NativeEngine(m, cfg)
    shared.add(Request("long", _prompt(600, 2), SamplingParams(0.0, max_new_tokens=200), seed=3))
    shared.step()   # the long request is in flight: every later step's span is >= 640 keys
    shared.add(Request("x", _prompt(20, 1), params, seed=7))
    got = _finish(shared)["x"]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_kv_migration_continues_bit_for_bit():
    m = _model()
    ref = NativeEngine(m, EngineConfig(max_running_requests=4, batch_invariant=False))
    ref.add(Request("x", _prompt(40, 5), SAMPLED, seed=11))
    want = _finish(ref)["x"]
    src = NativeEngine(m, EngineConfig(max_running_requests=4, batch_invariant=False))
    dst = NativeEngine(m, EngineConfig(max_running_requests=4, batch_invariant=False))
    src.add(Request("x", _prompt(40, 5), SAMPLED, seed=11))
    for _ in range(10):
        src.step()
    states = src.export_state(["x"])
    dst.import_state(states)
    src.commit_export(["x"])
    got = _finish(dst)["x"]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs and got.num_migrations == 1


def test_batched_prefill_matches_one_at_a_time_up_to_round_off():
    """What a prefill computes (each request's first token and its log-prob) is the same batched as one at a
    time, up to bf16 round-off: log-probs within 0.05, greedy tokens equal but for a near-tie. (The decode steps
    after it run other kernels in the two engines, so later tokens are not compared.)"""
    m = _model()
    first = SamplingParams(0.0, max_new_tokens=1)
    reqs = [Request(f"r{i}", _prompt(30 + 7 * i, 100 + i), first, seed=i) for i in range(16)]
    batched = NativeEngine(m, EngineConfig(max_running_requests=16, batch_invariant=False))
    for r in reqs:
        batched.add(r)
    fast = _finish(batched)
    single = NativeEngine(m, EngineConfig(max_running_requests=16, batch_invariant=True, cuda_graph=False,
                                          fused_kernels=True))   # the same prefill kernels, one request at a time
    for r in reqs:
        single.add(r)
    exact = _finish(single)
    gaps = [abs(fast[r.request_id].logprobs[0] - exact[r.request_id].logprobs[0]) for r in reqs]
    assert max(gaps) < 0.05, gaps
    same = sum(fast[r.request_id].token_ids == exact[r.request_id].token_ids for r in reqs)
    assert same >= len(reqs) - 1, same


def test_fused_kernels_compute_the_eager_math_and_free_with_the_weights():
    """The default CUDA engine packs projections and runs compiled elementwise stages: the same function as
    eager kernels up to bf16 round-off (first-token log-probs close, greedy tokens mostly equal), and its packed
    weights follow weight updates and a release/resume."""
    m = _model()
    prompts = [_prompt(30 + 7 * i, 10 + i) for i in range(8)]

    def run(fused, model=m):
        e = NativeEngine(model, EngineConfig(max_running_requests=8, batch_invariant=False, fused_kernels=fused))
        for i, p in enumerate(prompts):
            e.add(Request(f"q{i}", p, SamplingParams(0.0, max_new_tokens=16), seed=i))
        return e, _finish(e)

    fused_engine, fused = run(True)
    assert "fused=1" in fused_engine.numerics
    _, eager = run(False)
    first = torch.tensor([[fused[k].logprobs[0], eager[k].logprobs[0]] for k in fused])
    assert (first[:, 0] - first[:, 1]).abs().max() < 0.05
    same = sum(fused[k].token_ids[:4] == eager[k].token_ids[:4] for k in fused)
    assert same >= 6, f"only {same} of 8 requests agree on their first 4 greedy tokens"
    # a weight update lands in the packed weights: fused generation follows the new weights as eager does
    new = init_global_weights(ARGS, 1)
    fused_engine.update_weights(new, 1)
    fused_engine.release_memory(offload=True)
    fused_engine.resume()
    for i, p in enumerate(prompts):
        fused_engine.add(Request(f"r{i}", p, SamplingParams(0.0, max_new_tokens=16), seed=i))
    after = _finish(fused_engine)
    m2 = Transformer(ARGS, dtype=torch.bfloat16, device="cuda")
    m2.load_global(new)
    _, eager_new = run(False, m2)
    lp = torch.tensor([[after[f"r{i}"].logprobs[0], eager_new[f"q{i}"].logprobs[0]] for i in range(8)])
    assert (lp[:, 0] - lp[:, 1]).abs().max() < 0.05


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(12, 2, 128), (8, 8, 64), (32, 8, 128)])
def test_triton_decode_attention_is_attention_and_depends_on_the_row_only(heads, kv_heads, head_dim):
    g = torch.Generator(device="cuda").manual_seed(0)
    slots, seq = 6, 1100

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    k_cache, v_cache = randn(slots, kv_heads, seq, head_dim), randn(slots, kv_heads, seq, head_dim)
    pos = torch.tensor([0, 255, 256, 700, 1023, 5], device="cuda")   # chunk edges and a lone key
    rows = torch.tensor([4, 0, 1, 5, 2, 3], device="cuda")
    q, k_new, v_new = randn(6, heads, head_dim), randn(6, kv_heads, head_dim), randn(6, kv_heads, head_dim)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = decode_attention_fused(q, k_new, v_new, kc, vc, rows, pos, span=1024)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[rows, :, pos], want_v[rows, :, pos] = k_new, v_new
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    rep = heads // kv_heads
    for r in range(6):
        k = want_k[rows[r], :, :pos[r] + 1].float().repeat_interleave(rep, 0)
        v = want_v[rows[r], :, :pos[r] + 1].float().repeat_interleave(rep, 0)
        ref = torch.softmax(q[r].float()[:, None] @ k.transpose(1, 2) / head_dim ** 0.5, -1) @ v
        torch.testing.assert_close(out[r].float(), ref[:, 0], atol=2e-2, rtol=2e-2)
    # a longer span (a larger grid) and other rows' queries change no bit of a row
    q2 = q.clone()
    q2[0] = randn(heads, head_dim)
    again = decode_attention_fused(q2, k_new, v_new, k_cache.clone(), v_cache.clone(), rows, pos, span=1100)
    assert torch.equal(again[1:], out[1:])


def test_triton_decode_attention_applies_rope_as_the_compiled_rope_qk_does():
    """q and the new K passed unrotated, as strided views of one packed projection, with the rows' cos/sin: the
    result is the kernel's on q and K rotated by the fp32 math rounded once (what Inductor compiles `rope_qk`
    to), up to one rounding of a rotated element (the compilers may contract the products differently)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    r, heads, kv_heads, d, slots, seq = 5, 12, 2, 128, 6, 1100

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    qkv = randn(r, (heads + 2 * kv_heads) * d)
    q, k, v = (x.view(r, -1, d) for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], -1))
    pos = torch.tensor([0, 255, 256, 700, 1023], device="cuda")
    rows = torch.tensor([4, 0, 1, 5, 2], device="cuda")
    shape = ModelArgs(vocab_size=64, num_heads=heads, num_kv_heads=kv_heads, hidden_size=heads * d, max_seq_len=seq,
                      rope_theta=1e6)
    cos_t, sin_t = rope_tables(shape, "cuda")
    cos, sin = cos_t[pos].to(torch.bfloat16), sin_t[pos].to(torch.bfloat16)

    def rotated(x):
        rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return (x.float() * cos[:, None].float() + rot.float() * sin[:, None].float()).to(torch.bfloat16)

    k_cache, v_cache = randn(slots, kv_heads, seq, d), randn(slots, kv_heads, seq, d)
    kc1, vc1 = k_cache.clone(), v_cache.clone()
    want = decode_attention_fused(rotated(q), rotated(k), v, kc1, vc1, rows, pos, span=1024)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    got = decode_attention_fused(q, k, v, kc2, vc2, rows, pos, span=1024, cos_RD=cos, sin_RD=sin)
    assert torch.equal(vc1, vc2)
    ulp = 2.0 ** -7 * kc1.float().abs().clamp_min(2.0 ** -60)
    assert ((kc1.float() - kc2.float()).abs() <= ulp).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # the rotation's rows are the rows' own: another row's position changes no bit of a row
    pos2, cos2, sin2 = pos.clone(), cos.clone(), sin.clone()
    pos2[0], cos2[0], sin2[0] = 9, cos_t[9].to(torch.bfloat16), sin_t[9].to(torch.bfloat16)
    again = decode_attention_fused(q, k, v, k_cache.clone(), v_cache.clone(), rows, pos2, span=1024, cos_RD=cos2,
                                   sin_RD=sin2)
    assert torch.equal(again[1:], got[1:])


def test_compact_rows_compute_the_active_requests_only_and_what_holds_across_buckets():
    """The default engine here computes a bucket of rows gathered from the active slots. A request decoded in a
    bucket of 8 rows has the bits it has in an engine computing all 64 slots (measured on an H200 at this model's
    size: the GEMMs' rows do not depend on the batch here; cuBLAS may pick split-K kernels by batch size at
    other sizes, so across buckets the guarantee is round-off). Among 40 others (a batched prefill, buckets 64
    down to 8) its tokens agree up to round-off."""
    m = _model()
    cfg = EngineConfig(max_running_requests=64, batch_invariant=False)
    alone = NativeEngine(m, cfg)
    assert "compact=1" in alone.numerics
    alone.add(Request("x", _prompt(20, 1), GREEDY, seed=7))
    want = _finish(alone)["x"]
    full = NativeEngine(m, EngineConfig(max_running_requests=64, batch_invariant=False, compact_rows=False))
    full.add(Request("x", _prompt(20, 1), GREEDY, seed=7))
    every_slot = _finish(full)["x"]
    assert every_slot.token_ids == want.token_ids and every_slot.logprobs == want.logprobs
    shared = NativeEngine(m, cfg)
    for i in range(40):
        shared.add(Request(f"o{i}", _prompt(10 + i, 50 + i), SamplingParams(1.0, max_new_tokens=8 + i), seed=i))
    shared.add(Request("x", _prompt(20, 1), GREEDY, seed=7))
    got = _finish(shared)["x"]
    assert abs(got.logprobs[0] - want.logprobs[0]) < 0.05
    assert sum(a == b for a, b in zip(got.token_ids, want.token_ids)) >= len(want.token_ids) // 2


@pytest.mark.parametrize("block", [64, 256])
def test_triton_decode_attention_reads_a_paged_cache_as_a_contiguous_one(block):
    """The same slots laid out in shuffled blocks (block 0 left as the null block): the output and the written
    K/V are bit-identical to the contiguous layout's (a 64-key load lies in one block, so the sums are the same)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    slots, kv_heads, heads, d, seq = 5, 2, 12, 128, 1024

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    kc0, vc0 = randn(slots, kv_heads, seq, d), randn(slots, kv_heads, seq, d)
    pos = torch.tensor([0, 63, 64, 700, 1023], device="cuda")   # block edges at 64 and 256
    rows = torch.tensor([2, 0, 3, 1, 4], device="cuda")
    q, k_new, v_new = randn(5, heads, d), randn(5, kv_heads, d), randn(5, kv_heads, d)
    kc, vc = kc0.clone(), vc0.clone()
    want = decode_attention_fused(q, k_new, v_new, kc, vc, rows, pos, span=seq)
    per = seq // block
    table = (torch.randperm(slots * per, generator=torch.Generator().manual_seed(0)) + 1).view(slots, per)
    table = table.to(device="cuda", dtype=torch.int32)
    kp, vp = randn(slots * per + 1, kv_heads, block, d), randn(slots * per + 1, kv_heads, block, d)
    for s in range(slots):
        for j in range(per):
            span = slice(j * block, (j + 1) * block)
            kp[table[s, j]], vp[table[s, j]] = kc0[s, :, span], vc0[s, :, span]
    got = decode_attention_fused(q, k_new, v_new, kp, vp, rows, pos, span=seq, block_table=table)
    assert torch.equal(got, want)
    for s in range(slots):
        for j in range(per):
            assert torch.equal(kp[table[s, j]], kc[s, :, j * block:(j + 1) * block])
            assert torch.equal(vp[table[s, j]], vc[s, :, j * block:(j + 1) * block])


def test_paged_engine_block_size_changes_no_bits_and_a_tight_budget_preempts():
    """KV blocks of 64 or 256 positions give the same tokens and log-probs, bit for bit. A budget of a few
    blocks preempts requests (re-prefilled in a batched prefill, so equal only up to round-off): every request
    still finishes with its length, and at least half with the same tokens."""
    m = _model()
    params = [SamplingParams(0.0, max_new_tokens=200), SamplingParams(1.0, max_new_tokens=200)]
    reqs = [Request(f"r{i}", _prompt(30 + 7 * i, 90 + i), params[i % 2], seed=i) for i in range(12)]

    def run(**kw):
        engine = NativeEngine(m, EngineConfig(max_running_requests=12, batch_invariant=False, **kw))
        for r in reqs:
            engine.add(r)
        return engine, _finish(engine)

    _, want = run()
    _, small = run(kv_block_size=64)
    assert {k: (r.token_ids, r.logprobs) for k, r in small.items()} == {k: (r.token_ids, r.logprobs)
                                                                          for k, r in want.items()}
    block_bytes = 2 * ARGS.num_layers * ARGS.num_kv_heads * 64 * ARGS.head_dim * 2
    tight, got = run(kv_block_size=64, kv_budget_bytes=24 * block_bytes)   # 23 blocks + the null block
    assert tight.preemptions > 0 and tight.cache.free_blocks == 23
    assert all(len(got[k].token_ids) == len(want[k].token_ids) for k in want)
    assert all(abs(got[k].logprobs[0] - want[k].logprobs[0]) < 0.05 for k in want)
    assert sum(got[k].token_ids == want[k].token_ids for k in want) >= 6


@pytest.mark.parametrize("hidden,qkv,inter", [(1536, 2048, 8960), (256, 512, 512)])
def test_triton_decode_gemms_are_the_product_and_a_row_does_not_depend_on_the_batch(hidden, qkv, inter):
    """Each decode GEMM equals the fp32 product of its bf16 inputs up to bf16 round-off, its fused stage (bias,
    SiLU product, residual add + norm) computes the eager math, and a row's output bits are the same computed
    alone, among 8, 64 or 200 rows (fixed K splits, no batch-dependent kernel choice)."""
    from tidal.engine.generation import decode_gemm as dg
    from tidal.engine.model import add_rms_norm, silu_mul

    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)

    x, act = rand(200, hidden), rand(200, inter)
    w_qkv, b_qkv = rand(qkv, hidden, scale=hidden ** -0.5), rand(qkv)
    w_gu, w_o, w_d = rand(2 * inter, hidden, scale=hidden ** -0.5), rand(hidden, hidden, scale=hidden ** -0.5), \
        rand(hidden, inter, scale=inter ** -0.5)
    resid, norm_w = rand(200, hidden), rand(hidden)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    def close_ulp(a, b):   # within two bf16 rounding steps (the norm rounds twice: normalised, then scaled)
        return bool(((a.float() - b.float()).abs() <= 2 ** -6 * b.float().abs().clamp_min(1e-3)).all())

    cfg_qkv, cfg_gu = dg.config_for("qkv", qkv, hidden), dg.config_for("gate_up", inter, hidden)
    cfg_o, cfg_d = dg.config_for("o", hidden, hidden), dg.config_for("down", hidden, inter)
    y = dg.linear(x, w_qkv, b_qkv, cfg_qkv)
    assert rel(y, x.float() @ w_qkv.float().T + b_qkv.float()) < 1e-2
    gate = dg.linear(x, w_gu[:inter], None, dg.GemmConfig(cfg_gu.block_n, cfg_gu.block_k))
    up = dg.linear(x, w_gu[inter:], None, dg.GemmConfig(cfg_gu.block_n, cfg_gu.block_k))
    a = dg.gate_up_silu(x, w_gu, cfg_gu)
    assert rel(gate, x.float() @ w_gu[:inter].float().T) < 1e-2
    assert close_ulp(a, silu_mul(gate.float(), up.float()).to(torch.bfloat16))
    for w, inp, cfg in ((w_o, x, cfg_o), (w_d, act, cfg_d)):
        parts = dg.linear_partials(inp, w, cfg)
        assert parts.shape[0] == -(-w.shape[1] // cfg.k_per_split(w.shape[1]))
        assert rel(parts.sum(0), inp.float() @ w.float().T) < 1e-3
        x_new, h = dg.reduce_add_rms_norm(parts, resid, norm_w, 1e-6)
        want_x, want_h = add_rms_norm(resid, parts.sum(0).to(torch.bfloat16), norm_w, 1e-6)
        assert close_ulp(x_new, want_x) and close_ulp(h, want_h)
    # a row's bits: alone, among 8, 64, 200
    outs = {m: (dg.linear(x[:m], w_qkv, b_qkv, cfg_qkv), dg.gate_up_silu(x[:m], w_gu, cfg_gu),
                dg.reduce_add_rms_norm(dg.linear_partials(act[:m], w_d, cfg_d), resid[:m], norm_w, 1e-6)[1])
            for m in (1, 8, 64, 200)}
    for m in (8, 64, 200):
        for got, want in zip(outs[m], outs[1]):
            assert torch.equal(got[:1], want)


def test_triton_decode_gemms_in_the_engine_compute_the_cublas_step_up_to_round_off():
    """The default CUDA engine runs its decode projections on the Triton GEMMs (`gemm=triton` in its numerics):
    the function the cuBLAS step computes, up to bf16 round-off."""
    m = _model()
    prompts = [_prompt(30 + 7 * i, 10 + i) for i in range(8)]

    def run(gemm, **kw):
        e = NativeEngine(m, EngineConfig(max_running_requests=8, batch_invariant=False, decode_gemm=gemm, **kw))
        for i, p in enumerate(prompts):
            e.add(Request(f"q{i}", p, SamplingParams(0.0, max_new_tokens=16), seed=i))
        return e, _finish(e)

    engine, triton = run(None)
    assert "gemm=triton" in engine.numerics
    cublas_engine, cublas = run("cublas")
    assert "gemm=cublas" in cublas_engine.numerics
    second = torch.tensor([[triton[k].logprobs[1], cublas[k].logprobs[1]] for k in triton
                           if triton[k].token_ids[0] == cublas[k].token_ids[0]])
    assert len(second) >= 6 and (second[:, 0] - second[:, 1]).abs().max() < 0.05
    same = sum(triton[k].token_ids[:4] == cublas[k].token_ids[:4] for k in triton)
    assert same >= 6, f"only {same} of 8 requests agree on their first 4 greedy tokens"


def test_the_sampling_kernel_draws_the_torch_samplers_tokens_and_log_probs():
    """Rows without top-k/top-p sample in one Triton kernel on CUDA (`sample_kernel`): with the same uniforms it
    draws the torch sampler's tokens (the inverse CDF in vocab order; greedy the lowest argmax) up to fp32
    round-off at a block boundary, and the log-probs agree to fp32 round-off; a vocab-limited view reads only
    its ids."""
    from tidal.engine.generation import sample_kernel, sampler

    g = torch.Generator(device="cuda").manual_seed(0)
    n, v = 512, 151936
    logits = (torch.randn(n, v, generator=g, device="cuda") * 4).to(torch.bfloat16)
    view = logits[:, :151665]
    temp = torch.tensor([0.0, 1.0, 0.6, 1.2], device="cuda").repeat(n // 4)
    u = torch.rand(n, generator=g, device="cuda")
    tok, lp = sample_kernel.sample_logprobs(view, temp, u)
    ones, zeros = torch.ones(n, device="cuda"), torch.zeros(n, dtype=torch.long, device="cuda")
    ref = sampler.sample(view.float(), temp, ones, zeros, u, filtered=False)
    assert (tok == ref).float().mean() > 0.99 and bool((tok[temp <= 0] == ref[temp <= 0]).all())
    assert int(tok.max()) < 151665
    agree = tok == ref
    assert (lp[agree] - sampler.logprobs(view.float(), tok)[agree]).abs().max() < 1e-4
