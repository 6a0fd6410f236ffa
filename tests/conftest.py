"""Shared fixtures: tiny Hugging Face checkpoints as a user brings them (transformers' own config classes and
`save_pretrained`, a BPE tokenizer with a chat template, generation_config.json) and GSM8K-format prompt files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

FAMILY_CONFIGS = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 12}),
    "llama": ("LlamaConfig", {}),
}


def make_hf_checkpoint(path: Path, family: str, seed: int = 0, **config) -> Path:
    """A tiny random checkpoint of `family` with the BPE tokenizer of the addition task's text."""
    import transformers

    from tidal.engine.hf_tokenizer import train_bpe_tokenizer
    texts = [f"<|im_start|>user\n{a}+{b}=<|im_end|>\n<|im_start|>assistant\n#### {a + b}<|im_end|>\n"
             for a in range(100, 140) for b in range(500, 520)]
    train_bpe_tokenizer(texts, path, vocab_size=300)
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    cls, extra = FAMILY_CONFIGS[family]
    cfg = getattr(transformers, cls)(**{
        "vocab_size": -(-len(tok) // 64) * 64, "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 128,
        "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, **extra, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_token_id,
                                                             "pad_token_id": tok.pad_token_id}))
    return path


def make_gsm8k_files(path: Path, n_train: int = 64, n_val: int = 16) -> tuple[Path, Path]:
    """GSM8K-layout jsonl files of addition problems: {"question": "123+456=", "answer": "... #### 579"}."""
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"{100 + i}+{500 + 3 * i}=", "answer": f"The sum is #### {600 + 4 * i}"}
            for i in range(n_train + n_val)]
    train, val = path / "train.jsonl", path / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:n_train]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[n_train:]))
    return train, val


@pytest.fixture
def hf_run_inputs(tmp_path):
    """`make(family) -> overrides`: config overrides that train `family` from files, as a user's run would."""
    def make(family: str, **config) -> list[str]:
        ckpt = make_hf_checkpoint(tmp_path / f"ckpt-{family}", family, **config)
        train, val = make_gsm8k_files(tmp_path / "data")
        return [f"model.path={ckpt}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                "data.prompt_key=question", "data.max_prompt_length=20"]
    return make


@pytest.fixture(scope="module")
def shared_ray():
    """One embedded Ray for a module's runs (`pytestmark = pytest.mark.usefixtures("shared_ray")`): each run's
    worker group borrows the live connection (`tidal.workers.ray_env.connect`) and leaves Ray up when it closes, so
    a module pays Ray's start (~3 s) and shutdown (~1.5 s) once, not once per run; its workers are still started
    and killed by each run. Ray is shut down at the module's end: a later module may fork the test process
    (tests/test_db.py), and a fork must not inherit Ray's threads."""
    from tidal.workers.ray_env import connect

    session = connect()
    try:
        yield session
    finally:
        import ray

        ray.shutdown()


#: telemetry off for the services a test starts
TELEMETRY = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}


@pytest.fixture(scope="module")
def local_prefect():
    """A temporary Prefect server and database for this module's flow runs (no PREFECT_API_URL needed)."""
    saved = {k: os.environ.get(k) for k in TELEMETRY}
    os.environ.update(TELEMETRY)
    from prefect.testing.utilities import prefect_test_harness
    try:
        with prefect_test_harness(server_startup_timeout=120):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
