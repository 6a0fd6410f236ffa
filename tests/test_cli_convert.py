"""`tidal convert rlinf FILE [-o PATH]`: YAML on stdout or in PATH, the keys not carried on stderr with their
reasons, and the output accepted by `tidal validate` (against a real tiny Qwen2 checkpoint and data files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

transformers = pytest.importorskip("transformers")

from tidal.cli import main as cli  # noqa: E402
from tidal.convert.rlinf import convert_file  # noqa: E402
from tidal.engine.hf_tokenizer import train_bpe_tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "rlinf"
COLLOCATED = DATA / "qwen2.5-1.5b-grpo-fsdp-collocated.yaml"   # data: train.jsonl / test.jsonl, question + answer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A real tiny Qwen2 checkpoint (transformers' save_pretrained) with a BPE tokenizer; long enough for the
    fixture's runner.seq_length (2048)."""
    path = tmp_path_factory.mktemp("rlinf") / "model"
    cfg = transformers.Qwen2Config(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=4096)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    train_bpe_tokenizer(["Natalia sold 48 clips in April and half as many in May. #### 72"] * 5, path, vocab_size=300)
    return path


@pytest.fixture(autouse=True)
def rlinf_env(tmp_path, monkeypatch, model_dir):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(4)]
    for name in ("train.jsonl", "test.jsonl"):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("RLINF_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("RLINF_DATA_DIR", str(data))
    return data


def test_convert_to_file_then_validate(tmp_path, capsys, model_dir, rlinf_env):
    out = tmp_path / "tidal.yaml"
    assert cli.main(["convert", "rlinf", str(COLLOCATED), "-o", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout == ""
    conv = convert_file(COLLOCATED)
    doc = yaml.safe_load(out.read_text())
    assert doc == conv.config
    assert doc["model"]["path"] == str(model_dir)
    assert doc["data"]["train_files"] == [str(rlinf_env / "train.jsonl")]
    assert conv.dropped
    for d in conv.dropped:   # every key not carried is on stderr, with its reason
        line = next(ln for ln in stderr.splitlines() if ln.split() and ln.split()[0] == d.key)
        assert " ".join(d.reason.split()) in " ".join(line.split())
    # RLinf's collocated placement and rollout TP 2 are carried as they are; the pipeline runs neither yet, and
    # convert says so with the message `tidal validate` (and `tidal train`) give
    assert f"wrote {out}" in stderr and "does not validate here: rollout.tensor_parallel_size" in stderr
    assert cli.main(["validate", str(out)]) == 2
    refusal = capsys.readouterr().err.strip().removeprefix("error: ")
    assert f"does not validate here: {refusal}" in stderr


def test_convert_to_stdout(capsys):
    assert cli.main(["convert", "rlinf", str(COLLOCATED)]) == 0
    stdout, stderr = capsys.readouterr()
    assert yaml.safe_load(stdout) == convert_file(COLLOCATED).config
    assert stdout.startswith("# Tidal config converted from the RLinf config")
    assert "not carried (" in stderr and "hydra.run.dir" in stderr


@pytest.mark.parametrize("argv, needle", [
    (["convert", "rlinf", "nope.yaml"], "file not found"),
    (["convert", "verl", "x.yaml"], "not a config format"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_bad_yaml_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [unclosed\n")
    assert cli.main(["convert", "rlinf", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_convert_help(capsys):
    assert cli.main(["convert", "--help"]) == 0
    assert "rlinf" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert "convert" in capsys.readouterr().out
