"""Damaged Hugging Face checkpoints are refused before any weight is read: each one below, made from a tiny valid
checkpoint, makes `tidal validate` (and `tidal model check --no-parity`) exit 2 with one line naming the file or
the config.json field, within tests/hostile.py's time and memory bounds, without a traceback or a hang. A valid
checkpoint (also laid out as a Hugging Face hub cache snapshot, whose files link into `../../blobs`) validates;
NaN weights, which only reading can see, fail `load_hf_weights` naming the tensor and its file."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import make_gsm8k_files, make_hf_checkpoint
from hostile import Case, assert_refused, run_cases
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models

from tidal.engine.checkpoint import CheckpointError
from tidal.engine.hf_checkpoint import load_hf_weights, read_hf_config

RUN_YAML = """\
run: {num_steps: 1, seed: 1}
cluster: {num_devices_per_node: 3, component_placement: {actor: "0", rollout: "1", inference: "2"}}
actor: {micro_batch_size: 8, lr: 1.0e-3, warmup_iters: 0}
rollout: {max_new_tokens: 8, max_running_requests: 16}
algorithm: {group_size: 4, n_minibatches: 2}
data: {rollout_batch_size: 8, eval_size: 8, prompt_key: question, max_prompt_length: 20}
"""
WEIGHTS = "model.safetensors"
LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE_TEMPLATE = "{% for i in range(100000) %}{{ '" + "x" * 40 + "' }}{% endfor %}"


def _config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _tensors(d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(d / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})


def _cut(d: Path, name: str, keep: int) -> None:
    """Keep the first `keep` bytes of the file (negative: drop the last -keep)."""
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[:keep])


def _link(d: Path, name: str, target: str | Path) -> None:
    (d / name).unlink(missing_ok=True)
    os.symlink(target, d / name)


def _one_token_tokenizer(d: Path) -> None:
    """A tokenizer.json that loads but encodes a sentence as at most one token: a word-level model without a
    pre-tokenizer sees the whole sentence as one unknown word."""
    vocab = {"<unk>": 0, "<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3}
    RawTokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(d / "tokenizer.json"))


def _outside(d: Path) -> None:
    outside = d.parent / f"{d.name}-elsewhere"
    outside.mkdir()
    shutil.move(str(d / WEIGHTS), outside / WEIGHTS)
    _link(d, WEIGHTS, outside / WEIGHTS)


def _config_dir(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").mkdir()


def _header_bytes(d: Path, header: bytes, length: int | None = None) -> None:
    """The weight file replaced by `header` behind a length field of `length` (default: the header's own), then 64
    zero bytes of data."""
    n = len(header) if length is None else length
    (d / WEIGHTS).write_bytes(n.to_bytes(8, "little") + header + b"\0" * 64)


def _in(*words: str) -> list[str]:
    """The words an error about a file of the directory names: model.path, then `words`."""
    return ["model.path", *words]


def _entry(dtype: str, numel: int, nbytes: int) -> bytes:
    """A one-tensor header: norm.weight of `numel` elements of `dtype`, said to take `nbytes`."""
    return json.dumps({"model.norm.weight": {"dtype": dtype, "shape": [numel], "data_offsets": [0, nbytes]}}).encode()


#: case -> (how to damage a copy of the valid checkpoint, words its error line must hold: the field and the file)
DAMAGE: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    # the weight files
    "weights: truncated inside the header": (lambda d: _cut(d, WEIGHTS, 40), _in(WEIGHTS, "truncated")),
    "weights: zero bytes": (lambda d: _cut(d, WEIGHTS, 0), _in(WEIGHTS, "shorter than")),
    "weights: garbage": (lambda d: (d / WEIGHTS).write_bytes(bytes(range(256)) * 64), _in(WEIGHTS)),
    "weights: header of 2**40 bytes": (lambda d: _header_bytes(d, b"{}", 2 ** 40), _in(WEIGHTS, "header")),
    "weights: header not JSON": (lambda d: _header_bytes(d, b"\xff\xfe not json"), _in(WEIGHTS, "JSON")),
    "weights: header a JSON list": (lambda d: _header_bytes(d, b"[1, 2, 3]"), _in(WEIGHTS, "not an object")),
    "weights: unknown dtype": (lambda d: _header_bytes(d, _entry("Q4", 48, 64)), _in(WEIGHTS, "Q4")),
    "weights: offsets disagree with the shape": (lambda d: _header_bytes(d, _entry("F32", 48, 64)),
                                                 _in(WEIGHTS, "192 bytes")),
    "weights: truncated data": (lambda d: _cut(d, WEIGHTS, -100), _in(WEIGHTS, "truncated")),
    "weights: a tensor missing": (lambda d: _tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                                  _in("layers.1.mlp.up_proj.weight", "missing")),
    "weights: a tensor of the wrong shape": (
        lambda d: _tensors(d, lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(48, 95)})),
        _in("layers.0.mlp.down_proj.weight", "shape")),
    "weights: a symlink out of the directory": (_outside, _in(WEIGHTS, "outside the checkpoint directory")),
    # config.json
    "config.json: a directory": (_config_dir, _in("config.json", "not a regular file")),
    "config.json: a symlink loop": (lambda d: _link(d, "config.json", "config.json"), _in("config.json", "symbolic")),
    "config.json: a symlink to /dev/zero": (lambda d: _link(d, "config.json", "/dev/zero"),
                                            _in("config.json", "not a regular file")),
    "config.json: head_dim a string": (lambda d: _config(d, head_dim="12"), ["config.json: head_dim"]),
    "config.json: RoPE factor a string": (lambda d: _config(d, rope_parameters={
        "rope_type": "linear", "factor": "8.0", "rope_theta": 10000.0}), ["config.json: rope_parameters.factor"]),
    "config.json: sliding_window a string": (lambda d: _config(d, sliding_window="4096", use_sliding_window=True),
                                             ["config.json: sliding_window"]),
    "config.json: torch_dtype a list": (lambda d: _config(d, dtype=None, torch_dtype=["bfloat16"]),
                                        ["config.json: torch_dtype"]),
    "config.json: layer_types a number": (lambda d: _config(d, layer_types=2), ["config.json: layer_types"]),
    "config.json: hidden_size 2**40": (lambda d: _config(d, hidden_size=2 ** 40), ["config.json: hidden_size"]),
    "config.json: vocab_size true": (lambda d: _config(d, vocab_size=True), ["config.json: vocab_size"]),
    # the tokenizer
    "tokenizer: no tokenizer.json": (lambda d: (d / "tokenizer.json").unlink(), _in("tokenizer.json", "missing")),
    "tokenizer: tokenizer.json a symlink to /dev/zero": (lambda d: _link(d, "tokenizer.json", "/dev/zero"),
                                                         _in("tokenizer.json", "not a regular file")),
    "tokenizer: one token per sentence": (_one_token_tokenizer, _in("no real vocabulary")),
    "tokenizer: a chat template that never ends": (lambda d: (d / "chat_template.jinja").write_text(LOOPING_TEMPLATE),
                                                   ["data.apply_chat_template", "did not finish"]),
    "tokenizer: a chat template of megabytes": (lambda d: (d / "chat_template.jinja").write_text(HUGE_TEMPLATE),
                                                ["data.apply_chat_template", "characters"]),
}


def _hf_cache_snapshot(src: Path, root: Path) -> Path:
    """`src` laid out as the Hugging Face hub cache does: snapshots/<rev>/<file> -> ../../blobs/<file>."""
    repo = root / "models--tidal--tiny"
    snap, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in src.iterdir():
        shutil.copy(f, blobs / f.name)
        os.symlink(Path("..", "..", "blobs", f.name), snap / f.name)
    return snap


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> tuple[Path, dict[str, Path], Path, list[str]]:
    """(the valid checkpoint, each damaged copy by case, its HF-cache layout, the validate overrides)."""
    root = tmp_path_factory.mktemp("hostile-ckpt")
    good = make_hf_checkpoint(root / "good", "qwen2")
    train, val = make_gsm8k_files(root / "data")
    damaged = {}
    for i, (name, (damage, _)) in enumerate(DAMAGE.items()):
        d = root / f"case{i:02d}"
        shutil.copytree(good, d)
        damage(d)
        damaged[name] = d
    (root / "run.yaml").write_text(RUN_YAML)
    overrides = [f"data.train_files=[{train}]", f"data.val_files=[{val}]", f"run.output_dir={root / 'out'}"]
    return good, damaged, _hf_cache_snapshot(good, root / "hub"), [str(root / "run.yaml"), *overrides]


def _validate(d: Path, run: list[str]) -> list[str]:
    return ["validate", run[0], f"model.path={d}", *run[1:], "--no-track"]


def _cases(made, tool: str) -> list[Case]:
    """Every damaged checkpoint met by `tool`: "validate" or "model check"."""
    _, damaged, _, run = made
    argv = {n: _validate(d, run) if tool == "validate" else ["model", "check", str(d), "--no-parity"]
            for n, d in damaged.items()}
    return [Case(f"{tool} | {n}", argv[n], words) for n, (_, words) in DAMAGE.items()]


@pytest.fixture(scope="module")
def results(made, tmp_path_factory) -> dict[str, dict]:
    """Every case of this module, run once in one fresh process (tests/hostile.py)."""
    good, _, snapshot, run = made
    cases = [Case("valid", _validate(good, run), []), Case("valid, hub cache layout", _validate(snapshot, run), [])]
    cases += _cases(made, "validate") + _cases(made, "model check")
    return run_cases(cases, tmp_path_factory.mktemp("hostile-run"), timeout_s=300)


def test_a_valid_checkpoint_validates(results):
    for name in ("valid", "valid, hub cache layout"):
        r = results[name]
        assert r["rc"] == 0, f"{name}: {r['err'][-1500:]}"
        assert "ok" in r["out"] and "Qwen2ForCausalLM" in r["out"], r["out"]


def test_validate_refuses_every_damaged_checkpoint(made, results):
    assert_refused(_cases(made, "validate"), results)


def test_model_check_refuses_them_with_the_same_line(made, results):
    assert_refused(_cases(made, "model check"), results)
    for n in DAMAGE:
        said = {tool: results[f"{tool} | {n}"]["err"].strip().splitlines()[-1] for tool in ("validate", "model check")}
        assert said["validate"] == said["model check"], (n, said)


def test_nan_weights_fail_loading_naming_the_tensor_and_file(made, tmp_path):
    """validate reads no tensor data, so NaN weights pass it; loading them (each worker's `load_hf_weights`)
    refuses them before the first step, naming the tensor and its file."""
    good = made[0]
    d = shutil.copytree(good, tmp_path / "nan")

    def poison(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")
    _tensors(d, poison)
    with pytest.raises(CheckpointError) as err:
        load_hf_weights(read_hf_config(d, 64))
    msg = str(err.value)
    assert "model.layers.1.self_attn.k_proj.weight" in msg and WEIGHTS in msg and "1 non-finite" in msg, msg
    assert all(torch.isfinite(w).all() for w in load_hf_weights(read_hf_config(good, 64)).values())
