"""The Hugging Face inputs the GPU benchmarks run on: a random Qwen2 checkpoint of a named shape, written by
`transformers` in bf16 as released checkpoints are, with a small BPE tokenizer of the problems' text, and
GSM8K-format train / val files of addition problems (what a user brings: `model.path`, `data.train_files`).

The tokenizer's ~300 tokens are the generation's vocabulary (`vocab_limit`): a random model samples its eos with
probability ~1/300 per token, so response lengths are geometric (mean ~300) capped at `rollout.max_new_tokens`,
an RL rollout's long tail. A random model earns none of the task's reward; `PARITY_REWARD` rewards about half of
any model's samples (responses of even length), so every step trains.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: a reward that rewards about half of any model's samples (tests/parity_reward.py; see `importable_from_root`)
PARITY_REWARD = "tests.parity_reward:score"

QWEN25_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                   intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                   max_position_embeddings=4096)
QWEN25_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                   max_position_embeddings=4096)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=384, tie_word_embeddings=True, max_position_embeddings=512)
MODELS = {"qwen2.5-1.5b": QWEN25_1_5B, "qwen2.5-0.5b": QWEN25_0_5B, "tiny": TINY}


def importable_from_root() -> None:
    """The repository root on this process's path and on its workers' (PYTHONPATH): `PARITY_REWARD`'s module is
    imported by the driver and by every worker it starts."""
    root = str(ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))


def make_inputs(root: Path, shape: dict, n_train: int = 256) -> tuple[Path, Path, Path]:
    """(checkpoint, train file, val file) under `root` (module doc); the checkpoint is written once and reused."""
    import torch
    import transformers

    from tidal.engine.hf_tokenizer import train_bpe_tokenizer
    ckpt = root / "ckpt"
    rows = [{"question": f"{100 + i}+{500 + 3 * i}=", "answer": f"The sum is #### {600 + 4 * i}"}
            for i in range(n_train + 32)]
    texts = [f"<|im_start|>user\n{r['question']}<|im_end|>\n<|im_start|>assistant\n{r['answer']}<|im_end|>\n"
             for r in rows]
    if not (ckpt / "config.json").is_file():
        train_bpe_tokenizer(texts, ckpt, vocab_size=300)
        tok = transformers.AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
        cfg = transformers.Qwen2Config(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):   # init where it is fast
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        model.save_pretrained(str(ckpt))
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                                 "pad_token_id": tok.pad_token_id}))
        del model
    train, val = root / "train.jsonl", root / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:n_train]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[n_train:]))
    return ckpt, train, val


def matmul_params(shape: dict) -> int:
    """Parameters that take part in a matmul per token (the output head counted, the input lookup not; as
    benchmarks/train_throughput.py's N, norms left out)."""
    h, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + shape["vocab_size"] * h
