"""`tidal train`: bad inputs give one clear message and exit code 2 with nothing started or overwritten; `--flow`
runs the same job as the Prefect rl-training flow without a server."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tidal.cli.main import main

pytestmark = pytest.mark.usefixtures("shared_ray")

CONFIG = str(Path(__file__).resolve().parents[1] / "experiments" / "addition_dynamic.yaml")


def _train(tmp_path, *overrides):
    return main(["train", CONFIG, f"run.output_dir={tmp_path}", *overrides, "--no-track"])


def test_unknown_task_names_the_field_and_a_near_match(tmp_path, capsys):
    assert _train(tmp_path, "data.task=adition") == 2
    err = capsys.readouterr().err
    assert "data.task" in err and "addition" in err


def test_tokenizer_model_mismatch(tmp_path, capsys):
    assert _train(tmp_path, "model.vocab_size=50") == 2
    err = capsys.readouterr().err
    assert "vocab_size" in err and "Fix:" in err


def test_checkpoint_of_another_model_is_refused_and_left_alone(tmp_path, capsys):
    other = tmp_path / "other.safetensors"
    save_file({"embed_tokens.weight": torch.zeros(19, 64)}, str(other))
    before = other.read_bytes()
    assert _train(tmp_path, f"warm_start.checkpoint={other}") == 2
    err = capsys.readouterr().err
    assert "warm_start.checkpoint" in err and "does not fit this model" in err
    assert other.read_bytes() == before


@pytest.mark.parametrize("flow", [[], ["--flow"]])
def test_resume_from_a_missing_checkpoint(tmp_path, capsys, flow):
    """`--resume` is checked before anything starts, as a flow parameter too (`--flow`: the flow's resume_from)."""
    assert main(["train", CONFIG, f"run.output_dir={tmp_path}", "--no-track", *flow, "--resume",
                 str(tmp_path / "nothing-here")]) == 2
    err = capsys.readouterr().err
    assert "resume_from" in err and "nothing-here" in err and "Fix:" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_train_as_a_prefect_flow_without_a_server(tmp_path, monkeypatch):
    """`tidal train --flow`: the rl-training flow on a temporary local Prefect server (the embedded default)."""
    import json
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    out = tmp_path / "summary.json"
    # one device per component: what is checked is the flow around the job, whatever its placement
    assert main(["train", CONFIG, f"run.output_dir={tmp_path}", "run.num_steps=1", "warm_start.iters=20",
                 "data.eval_size=16", "cluster.num_devices_per_node=3",
                 "cluster.component_placement={actor: 0, rollout: 1, inference: 2}", "--flow", "--no-track",
                 "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 1 and len(summary["reward_per_step"]) == 1
