"""A built-in task as a user would bring it: a Hugging Face checkpoint directory and GSM8K-format prompt files.

    tidal warm-start CONFIG --out DIR
      DIR/data/train.jsonl, DIR/data/val.jsonl   {"question": "123+456=", "answer": "#### 975"} per line
      DIR/model/                                  Qwen2ForCausalLM config.json, model.safetensors, a BPE
                                                  tokenizer.json with a ChatML template, generation_config.json

The model is Tidal's own architecture (CONFIG's `model.*` keys) with Qwen2's q/k/v biases, its embedding padded to a
multiple of 64 rows past the tokenizer (as Qwen pads), supervised on the task's small noisy labelled set
(`warm_start.*`) to answer with the number (the files hold GSM8K's `#### N`; the `gsm8k` verifier reads a
response's last number), held-out accuracy measured through the native engine and that verifier. An RL config
then loads it through `model.path` and `data.train_files` exactly as it would a user's Qwen: the main job
exercises the same path a user's run does.

The directory is a cache: `DIR/model/tidal_warm_start.json` records the settings' key, and a second call with the
same settings returns at once. It is written into `DIR.tmp` and renamed, so a directory at DIR is complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tidal.core.config import TidalConfig, load_config
from tidal.core.errors import ConfigError
from tidal.engine.datasets import PromptLabel
from tidal.engine.evaluation import EvalItem, greedy_accuracy
from tidal.engine.hf_checkpoint import HFModel, hf_config_for, save_hf
from tidal.engine.hf_tokenizer import HFTokenizer, train_bpe_tokenizer
from tidal.engine.model import ModelArgs, Transformer, init_global_weights
from tidal.engine.rl_tasks import Task, get_task
from tidal.engine.verifier import Verifier
from tidal.engine.warmstart import EvalPoint, WarmStartSpec, plateaued, task_examples, warm_start

FORMAT = 2
MARKER = "tidal_warm_start.json"
ARCHITECTURE = "Qwen2ForCausalLM"
#: train prompts written to train.jsonl (the RL stream draws from them, epoch after epoch)
NUM_TRAIN_PROMPTS = 4096


def _answer(task: Task, prompt: str) -> str:
    return f"#### {task.answer(prompt)}"


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def settings_key(cfg: TidalConfig) -> str:
    ws, m = cfg.warm_start, cfg.model
    return hashlib.sha256(json.dumps([FORMAT, cfg.data.task, cfg.data.seed, cfg.data.eval_size, cfg.run.seed,
                                      ws.model_dump(), m.model_dump(), cfg.response_length],
                                     sort_keys=True).encode()).hexdigest()[:16]


def make_task_checkpoint(cfg: TidalConfig, out: str | Path,
                         log_fn: Callable[[EvalPoint], None] | None = None) -> dict[str, Any]:
    """Write (or find, if its settings match) the task's checkpoint and prompt files under `out`; returns the
    marker's content: settings key, warm-start history, held-out accuracy, paths."""
    out = Path(out)
    key = settings_key(cfg)
    marker = out / "model" / MARKER
    if marker.is_file():
        meta = json.loads(marker.read_text())
        if meta.get("key") == key:
            return meta
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    task, seed = get_task(cfg.data.task), cfg.data.seed
    train = task.train_prompts(NUM_TRAIN_PROMPTS, seed, 0)
    val = task.heldout_prompts(cfg.data.eval_size, seed)
    _write_jsonl(tmp / "data" / "train.jsonl", [{"question": p, "answer": _answer(task, p)} for p in train])
    _write_jsonl(tmp / "data" / "val.jsonl", [{"question": p, "answer": _answer(task, p)} for p in val])

    spec = WarmStartSpec.from_config(cfg.warm_start, cfg.data.eval_size, seed)
    examples = task_examples(task, spec)
    chat = [f"<|im_start|>user\n{e.prompt}<|im_end|>\n<|im_start|>assistant\n{e.response}<|im_end|>\n"
            for e in examples] + [f"#### {e.response}" for e in examples]
    model_dir = tmp / "model"
    tok = HFTokenizer(train_bpe_tokenizer(chat, tmp / "tokenizer", vocab_size=300))   # saved again with the model
    eos = tok.stop_ids[0]
    padded = -(-tok.vocab_size // 64) * 64
    args = replace(ModelArgs.from_config(cfg.model, padded), vocab_size=padded, qkv_bias=True)

    # the model answers with the number alone; the gsm8k verifier reads the last number of a response
    pairs = [(tok.prompt_ids(e.prompt), tok.hf.encode(e.response, add_special_tokens=False) + [eos])
             for e in examples]
    heldout = [EvalItem(tuple(tok.prompt_ids(p)), _label(i, task, p)) for i, p in enumerate(val)]
    verifier = Verifier("gsm8k")
    model = Transformer(args)
    model.load_global(init_global_weights(args, cfg.run.seed))
    history = warm_start(model, pairs, lambda m: greedy_accuracy(m, heldout, tok, verifier, cfg.response_length),
                         spec, tok.pad_id, log=log_fn) if spec.iters else []
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    exported = replace(args, max_seq_len=max(64, args.max_seq_len))
    config = hf_config_for(exported, ARCHITECTURE, eos_ids=(eos,), pad_id=tok.pad_id)
    hf = HFModel(str(model_dir), ARCHITECTURE, exported, "float32", exported.max_seq_len, config)
    save_hf(model_dir, weights, hf, tokenizer=tok, generation_config={"eos_token_id": eos, "pad_token_id": tok.pad_id})
    shutil.rmtree(tmp / "tokenizer")
    meta = {"key": key, "task": task.name, "architecture": ARCHITECTURE, "args": asdict(exported),
            "tokenizer_size": tok.vocab_size, "examples": len(examples), "iters": spec.iters,
            "history": [asdict(h) for h in history], "plateaued": bool(history) and plateaued(history),
            "heldout_accuracy": history[-1].heldout_accuracy if history else None,
            "model": str(out / "model"), "train_file": str(out / "data" / "train.jsonl"),
            "val_file": str(out / "data" / "val.jsonl")}
    (model_dir / MARKER).write_text(json.dumps(meta, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return meta


def _label(i: int, task: Task, prompt: str) -> PromptLabel:
    return PromptLabel(f"val:{i}", _answer(task, prompt), "val")


def main(argv: list[str]) -> int:
    """`tidal warm-start CONFIG --out DIR [key=value ...]`: the built-in task's checkpoint and prompt files."""

    ap = argparse.ArgumentParser(prog="tidal warm-start", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a config with Tidal's own model.* keys, data.task and warm_start.*")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides")
    ap.add_argument("--out", required=True, help="output directory (model/ and data/ inside)")
    args = ap.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    if cfg.model.path is not None:
        raise ConfigError("model.path", cfg.model.path, "the warm start builds Tidal's own model",
                          "drop model.path from the warm-start config")
    meta = make_task_checkpoint(cfg, args.out, log_fn=lambda p: print(
        f"warm start iter {p.iter}: loss {p.loss:.3f}, held-out accuracy {p.heldout_accuracy:.3f}", flush=True))
    acc = meta["heldout_accuracy"]
    print(f"{meta['model']}: {meta['architecture']}, held-out accuracy "
          f"{'n/a' if acc is None else f'{acc:.3f}'}; prompts {meta['train_file']}, {meta['val_file']}")
    return 0
