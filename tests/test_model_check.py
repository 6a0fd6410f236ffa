"""`tidal model check DIR`: the report of tiny Qwen2 / Qwen3 checkpoints written by transformers (with a BPE
tokenizer from `train_bpe_tokenizer`), logit parity with transformers, TP sizes, and unsupported or broken
directories as exit 2 with `{"supported": false}` in the JSON."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tidal.cli import main as cli  # noqa: E402
from tidal.cli import model_check  # noqa: E402
from tidal.engine.hf_tokenizer import train_bpe_tokenizer  # noqa: E402
from tidal.engine.model import ModelArgs  # noqa: E402

pytestmark = pytest.mark.usefixtures("shared_ray")

TEXTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
         "How many clips did Natalia sell altogether? Let's think step by step. #### 72",
         "The quick brown fox jumps over the lazy dog, 12 times in 3.5 seconds."] * 10
COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
              max_position_embeddings=512, rms_norm_eps=1e-6)


def _checkpoint(path, tok_dir, cls_name: str, dtype=torch.float32, **kw):
    cfg = getattr(transformers, cls_name)(**{**COMMON, **kw})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():   # random biases and norms, so parity exercises them; larger logits than the init's
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.mul_(20.0)
    model.to(dtype).save_pretrained(str(path))
    shutil.copytree(tok_dir, path, dirs_exist_ok=True)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    tok = train_bpe_tokenizer(TEXTS, root / "tok", vocab_size=300)
    qwen2 = _checkpoint(root / "qwen2", tok, "Qwen2Config", num_attention_heads=4, num_key_value_heads=2,
                        rope_theta=1000000.0)
    qwen3 = _checkpoint(root / "qwen3", tok, "Qwen3Config", dtype=torch.bfloat16, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=24, tie_word_embeddings=True)
    return {"qwen2": qwen2, "qwen3": qwen3, "tok": tok}


def _run(capsys, *argv):
    rc = cli.main(["model", "check", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_qwen2_report(ckpts, tmp_path, capsys):
    rc, out, err = _run(capsys, ckpts["qwen2"], "--json", tmp_path / "r.json")
    assert rc == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["supported"] is True and r["ok"] is True
    assert r["architecture"] == "Qwen2ForCausalLM" and r["model_type"] == "qwen2"
    want = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(str(ckpts["qwen2"])).parameters())
    assert r["num_params"] == want
    assert r["dtype"] == "float32" and r["weights"]["dtypes"] == ["float32"]
    assert (r["vocab_size"], r["tokenizer_vocab_size"], r["padded_embedding_rows"]) == (320, 300, 20)
    assert (r["num_heads"], r["num_kv_heads"], r["head_dim"], r["num_layers"]) == (4, 2, 16, 2)
    assert r["qkv_bias"] is True and r["qk_norm"] is False and r["tie_embeddings"] is False
    assert r["rope_type"] == "default" and r["max_position_embeddings"] == 512
    assert r["tp_sizes"] == [1, 2]
    assert r["has_chat_template"] is True and r["stop_ids"] == [2] and r["pad_id"] == 0
    assert r["rendered_prompt"].startswith("<|im_start|>user\nNatalia") and r["prompt_tokens"] > 20
    assert r["round_trip"]["ok"] is True
    p = r["parity"]
    assert p["status"] == "ok" and p["tokens"] == model_check.PARITY_TOKENS
    assert r["max_abs_logit_diff"] == p["max_abs_logit_diff"] < 1e-4
    assert p["max_abs_logit"] > 1.0          # the comparison is not between near-zero logits
    assert p["greedy_next_token_match"] is True
    assert p["memory_bytes"] == r["num_params"] * 8
    assert "Qwen2ForCausalLM" in out and "tensor parallel sizes" in out and "parity" in out
    assert "Loading weights" not in err


def test_qwen3_bf16_tied_report(ckpts, capsys):
    r = model_check.check(ckpts["qwen3"], prompt="What is 3 + 4?")
    assert r["architecture"] == "Qwen3ForCausalLM"
    assert r["dtype"] == "bfloat16" and r["weights"]["dtypes"] == ["bfloat16"]
    assert r["qk_norm"] is True and r["qkv_bias"] is False and r["tie_embeddings"] is True
    assert r["head_dim"] == 24 and r["tp_sizes"] == [1, 2, 4]
    assert r["prompt"] == "What is 3 + 4?" and r["prompt_tokens"] < model_check.PARITY_TOKENS
    assert r["parity"]["tokens"] == r["prompt_tokens"]
    assert r["max_abs_logit_diff"] < 1e-4 and r["parity"]["greedy_next_token_match"]


def test_tp_sizes_are_the_common_divisors_of_heads_and_kv_heads():
    assert model_check.tp_sizes(ModelArgs(vocab_size=8, hidden_size=96, num_heads=12, num_kv_heads=4)) == [1, 2, 4]
    assert model_check.tp_sizes(ModelArgs(vocab_size=8, hidden_size=96, num_heads=6, num_kv_heads=6)) == [1, 2, 3, 6]
    assert model_check.tp_sizes(ModelArgs(vocab_size=8, hidden_size=96, num_heads=12, num_kv_heads=1)) == [1]


def test_no_parity_and_max_seq_len(ckpts, tmp_path, capsys):
    rc, out, _ = _run(capsys, ckpts["qwen2"], "--no-parity", "--max-seq-len", "256", "--json", tmp_path / "r.json")
    assert rc == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["max_abs_logit_diff"] is None and r["parity"]["status"] == "skipped"
    assert r["parity"]["memory_bytes"] == r["num_params"] * 8 and r["max_seq_len"] == 256
    assert "skipped" in out and "x 4 B x 2" in out


def test_without_transformers_the_checks_needing_it_say_not_installed(ckpts, monkeypatch):
    monkeypatch.setattr(model_check, "_transformers", lambda: None)
    r = model_check.check(ckpts["qwen2"])
    assert r["supported"] is True and r["max_abs_logit_diff"] is None
    assert "not installed" in r["parity"]["reason"] and "not installed" in r["tokenizer"]
    assert r["tokenizer_vocab_size"] is None


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_exits_2(ckpts, tmp_path, capsys):
    path = _copy(ckpts["qwen2"], tmp_path / "moe")
    _edit_config(path, architectures=["Qwen2MoeForCausalLM"])
    rc, _, err = _run(capsys, path, "--json", tmp_path / "r.json")
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "architectures" in err and "not a supported family" in err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["supported"] is False and "Qwen2MoeForCausalLM" in r["error"]


def test_directory_without_tokenizer_files_exits_2_naming_the_tokenizer(ckpts, tmp_path, capsys):
    path = tmp_path / "notok"
    path.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        if (ckpts["qwen2"] / f).is_file():
            shutil.copy(ckpts["qwen2"] / f, path / f)
    rc, _, err = _run(capsys, path, "--json", tmp_path / "r.json")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "tokenizer" in err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["supported"] is False and "tokenizer" in r["error"]


def test_extra_tensor_is_unsupported_even_without_parity(ckpts, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    path = _copy(ckpts["qwen2"], tmp_path / "extra")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = _run(capsys, path, "--no-parity")
    assert rc == 2 and "o_proj.bias" in err and "not a parameter" in err


def test_model_help_lists_check(capsys):
    assert cli.main(["--help"]) == 0
    assert "model" in capsys.readouterr().out
    assert cli.main(["model", "--help"]) == 0
    assert "check" in capsys.readouterr().out
    assert cli.main(["model", "inspect"]) == 2
    assert "check" in capsys.readouterr().err
