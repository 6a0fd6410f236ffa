"""RL adds what supervision did not, through the path a user's model takes: the main job's warm start writes a
Hugging Face checkpoint and GSM8K-format prompt files (`tidal warm-start experiments/warmstart_addition.yaml`);
it has stopped improving on its small, noisy labelled set. The main job (`experiments/rlinf_dynamic.yaml`: 8 CPU
virtual devices, dynamic scheduling) trains that checkpoint through `model.path` and `data.train_files` with
only the gsm8k verifier, and raises held-out accuracy by >= 0.15 (mean of the last three evaluations).
"""

from pathlib import Path

import pytest

from tidal.config import load_config
from tidal.pipeline.run import run_training
from tidal.pipeline.task_checkpoint import make_task_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def test_rl_beats_a_plateaued_warm_start_through_the_hugging_face_path(tmp_path):
    meta = make_task_checkpoint(load_config(EXPERIMENTS / "warmstart_addition.yaml"), tmp_path / "warmstart")
    curve = [(h["iter"], round(h["heldout_accuracy"], 3)) for h in meta["history"]]
    assert meta["plateaued"], f"warm start still improving: {curve}"
    cfg = load_config(EXPERIMENTS / "rlinf_dynamic.yaml", [
        f"model.path={meta['model']}", f"data.train_files=[{meta['train_file']}]",
        f"data.val_files=[{meta['val_file']}]", f"run.output_dir={tmp_path}",
        "tracking.db_url=sqlite:///" + str(tmp_path / "t.db")])
    summary = run_training(cfg, tmp_path / "run")
    print(f"warm start curve {curve}; RL evals {summary.eval_per_step}; wall {summary.wall_s:.0f} s")
    start = summary.eval_accuracy_start
    assert abs(start - meta["heldout_accuracy"]) < 0.01   # RL starts from the checkpoint the warm start wrote
    last3 = [acc for _, acc in summary.eval_per_step[-3:]]
    gain = sum(last3) / 3 - start
    assert gain >= 0.15, f"RL gain {gain:.3f} (start {start:.3f}, last evals {last3})"
