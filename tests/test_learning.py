"""RL adds what supervision did not: the main job's warm start has stopped improving on its (small, noisy)
labelled set, and GRPO with only the verifier, on the prompt files, raises held-out accuracy by >= 0.15.

Runs the README's main job (`./scripts/main`) for real, through the path a user's run takes: the warm start
writes a Qwen2 checkpoint with a BPE tokenizer and GSM8K-format files (`tidal warm-start`), RL loads them through
model.path and data.train_files (`experiments/rlinf_dynamic.yaml`: 8 CPU virtual devices, dynamic scheduling).
"""

import json
from pathlib import Path

import pytest

from tidal.config import load_config
from tidal.pipeline.run import run_training
from tidal.pipeline.task_checkpoint import make_task_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def test_rl_beats_a_plateaued_warm_start(tmp_path):
    meta = make_task_checkpoint(load_config(EXPERIMENTS / "warmstart_addition.yaml"), tmp_path / "addition")
    cfg = load_config(EXPERIMENTS / "rlinf_dynamic.yaml", [
        f"run.output_dir={tmp_path}", "tracking.db_url=sqlite:///" + str(tmp_path / "t.db"),
        f"model.path={meta['model']}", f"data.train_files=[{meta['train_file']}]",
        f"data.val_files=[{meta['val_file']}]"])
    summary = run_training(cfg, tmp_path / "run")
    curve = [(h["iter"], round(h["heldout_accuracy"], 3)) for h in meta["history"]]
    print(f"warm start curve {curve}; RL evals {summary.eval_per_step}; wall {summary.wall_s:.0f} s")
    assert meta["plateaued"], f"warm start still improving: {curve}"
    start = summary.eval_accuracy_start
    assert abs(start - meta["heldout_accuracy"]) < 1e-9  # the pipeline starts from the warm start
    last3 = [acc for _, acc in summary.eval_per_step[-3:]]
    gain = sum(last3) / 3 - start
    assert gain >= 0.15, f"RL gain {gain:.3f} (start {start:.3f}, last evals {last3})"
