"""Hugging Face checkpoints: Tidal's model reproduces `transformers` on checkpoints `transformers` wrote.

Per family (Llama default and llama3 RoPE, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norms and an explicit
head_dim; tied and untied), a tiny random model is built by transformers' own config class and saved with
`save_pretrained` (fp32 and bf16, one sharded with an index). Loaded through `engine.hf_checkpoint`, Tidal's
logits match within 1e-4 over 520 positions (fp32), its native engine's 64 greedy tokens equal `generate`'s,
and strictness holds: a bias-bearing checkpoint never loads without its biases, an unknown RoPE type, a binding
sliding window and MoE layers are errors naming the key. `save_hf` round-trips through `AutoModelForCausalLM`.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tidal.engine.checkpoint import CheckpointError  # noqa: E402
from tidal.engine.generation import EngineConfig, NativeEngine, Request, SamplingParams  # noqa: E402
from tidal.engine.hf_checkpoint import INDEX_FILE, load_hf_weights, read_hf_config, save_hf, weight_files  # noqa: E402
from tidal.engine.model import Transformer  # noqa: E402

SEQ = 520
COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=1024, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_theta=10000.0)),
    "llama3_rope_tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, rope_theta=1000000.0)),
}


def _hf_model(family: str, **over):
    cls_name, kw = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **kw, **over})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():   # random biases and norms, so a dropped bias or norm changes the logits
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _save(model, path, dtype=torch.float32, **kw):
    model.to(dtype).save_pretrained(str(path), **kw)
    model.to(torch.float32)
    return path


def _ours(path, max_seq_len=SEQ + 8):
    hf = read_hf_config(path, max_seq_len)
    m = Transformer(hf.args)
    m.load_global(load_hf_weights(hf))
    return hf, m.eval()


def _ids(n, vocab=97, seed=1):
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    ref = _hf_model(family)
    hf, ours = _ours(_save(ref, tmp_path / family))
    assert hf.architecture == ref.config.architectures[0]
    ids = _ids(SEQ)
    with torch.no_grad():
        want = ref(ids).logits
        got = ours.full_logits(ours(ids))
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama3_rope_tied", "qwen2", "qwen3"])
def test_greedy_tokens_equal_generate(tmp_path, family):
    ref = _hf_model(family)
    _, ours = _ours(_save(ref, tmp_path / family), max_seq_len=96)
    prompt = _ids(12, seed=3)[0]
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=64, do_sample=False, min_new_tokens=64,
                            pad_token_id=0, eos_token_id=None)[0, 12:].tolist()
    eng = NativeEngine(ours, EngineConfig(max_running_requests=2))
    eng.add(Request("r0", tuple(prompt.tolist()), SamplingParams(0.0, max_new_tokens=64), seed=0))
    got = None
    while eng.has_work():
        for ev in eng.step():
            if ev.finished:
                got = list(ev.result.token_ids)
    assert got == want


def test_bf16_and_sharded_checkpoint_loads(tmp_path):
    ref = _hf_model("qwen2")
    path = _save(ref, tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size="40KB")
    assert (path / INDEX_FILE).is_file() and len(weight_files(path)) > 1
    hf, ours = _ours(path)
    assert hf.dtype == "bfloat16"
    ref_bf16 = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = _ids(SEQ)
    with torch.no_grad():
        assert (ours.full_logits(ours(ids)) - ref_bf16(ids).logits).abs().max().item() < 1e-4


def _drop_tensor(path, key):
    from safetensors.torch import load_file, save_file
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    del tensors[key]
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_bias_bearing_checkpoint_never_loads_without_its_biases(tmp_path):
    path = _save(_hf_model("qwen2"), tmp_path / "q")
    _drop_tensor(path, "model.layers.1.self_attn.k_proj.bias")
    with pytest.raises(CheckpointError, match="bias missing.*k_proj.bias"):
        load_hf_weights(read_hf_config(path, 64))


def test_unexpected_tensor_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file
    path = _save(_hf_model("llama"), tmp_path / "l")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="not a parameter.*o_proj.bias"):
        load_hf_weights(read_hf_config(path, 64))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, match", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type.*yarn"),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, "architectures.*not a supported family"),
    ({"num_experts": 8}, "MoE"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
])
def test_unsupported_configs_are_errors_naming_the_key(tmp_path, changes, match):
    path = _save(_hf_model("llama"), tmp_path / "l")
    _edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=match):
        read_hf_config(path, 64)


def test_sliding_window_is_an_error_only_where_it_binds(tmp_path):
    path = _save(_hf_model("mistral", sliding_window=128), tmp_path / "m")
    read_hf_config(path, 128)   # the window never binds within 128 tokens: exact
    with pytest.raises(CheckpointError, match="sliding_window.*bind"):
        read_hf_config(path, 129)


def test_transformers_4_rope_keys_are_read(tmp_path):
    ref = _hf_model("llama3_rope_tied")
    path = _save(ref, tmp_path / "t4")
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"rope_type": rope.pop("rope_type"), **rope}
    (path / "config.json").write_text(json.dumps(cfg))
    hf, ours = _ours(path)
    assert hf.args.rope_scaling.rope_type == "llama3" and hf.args.rope_theta == 500000.0
    ids = _ids(SEQ)
    with torch.no_grad():
        assert (ours.full_logits(ours(ids)) - ref(ids).logits).abs().max().item() < 1e-4


def test_missing_dir_and_files_are_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        read_hf_config(tmp_path / "nope", 64)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="file not found.*config.json"):
        read_hf_config(tmp_path / "empty", 64)
    path = _save(_hf_model("llama"), tmp_path / "l")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf_weights(read_hf_config(path, 64))


def test_max_seq_len_beyond_the_checkpoint_is_an_error(tmp_path):
    path = _save(_hf_model("llama"), tmp_path / "l")
    with pytest.raises(CheckpointError, match="max_position_embeddings=1024"):
        read_hf_config(path, 2048)


@pytest.mark.parametrize("family", ["qwen2_tied", "qwen3", "llama3_rope_tied"])
def test_save_hf_round_trip(tmp_path, family):
    ref = _hf_model(family)
    hf, ours = _ours(_save(ref, tmp_path / "src"))
    trained = {k: v + 0.01 * torch.randn_like(v) for k, v in load_hf_weights(hf).items()}
    if hf.args.tie_embeddings:
        trained.pop("lm_head.weight", None)
    out = save_hf(tmp_path / "out", trained, hf)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert back.config.architectures == ref.config.architectures
    ours.load_global(trained)
    ids = _ids(SEQ)
    with torch.no_grad():
        assert (back(ids).logits - ours.full_logits(ours(ids))).abs().max().item() < 1e-5
