"""What an `rl-training` flow run shows in the Prefect UI, as text: pure functions over the values a run returns.

    step 1 of 10  reward 0.412  held-out 0.563  3.84 s | generate 2.91  score 0.62  train 1.80 device-s  sync 0.21 s
        | 2 reshards 0.09 s  1 migration 0.02 s                      <- step_line(step, num_steps, metrics)
    progress_percent(2, 10) -> 20.0                                  <- the run's progress artifact
    mlflow_run_markdown(uri, exp, run)                               <- the MLflow artifact, as the run opens
    summary_markdown(summary, mlflow_run_markdown(uri, exp, run))   <- the markdown artifact at the end
    artifact_key("addition_dynamic", "summary") -> "addition-dynamic-summary"

Steps are numbered from 0 everywhere a run shows them: MLflow's step axis, the step subflows' names (`step-0`),
the timeline, the database's rows, the run warnings and this log line (`step 0 of 10` is the first of ten steps).

No Prefect here (tests call it directly); `tasks.training` writes the results to the flow run's log and artifacts.
A step's metrics are `TrainingRun.record`'s: `grpo/reward_mean`, `eval/heldout_accuracy` (on evaluated steps),
`step/time_s`, `phase/<role>_device_s` (device-seconds per role: rollout generates, inference scores, the actor trains),
`sync/time_s`, and the step's event aggregates
(`tidal.pipeline.run_metrics.step_event_metrics`): `reshard/count` + `reshard/total_s`, `migration/count` +
`migration/total_s`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tidal.core.secrets import redact
from tidal.tracking import ui_run_url

#: timeline role -> what the role does in a step, in the order a step does it
PHASES = (("rollout", "generate"), ("inference", "score"), ("actor", "train"))
MLFLOW_UI = "http://127.0.0.1:5000"   # where `mlflow ui` and `tidal up` serve a local store by default


def artifact_key(name: str, kind: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes only) for run `name`'s `kind` artifact."""
    base = re.sub(r"[^a-z0-9]+", "-", f"{name}-{kind}".lower()).strip("-")
    return base or kind


def _plural(n: float, word: str) -> str:
    return f"{int(n)} {word}{'' if int(n) == 1 else 's'}"


def step_line(step: int, num_steps: int, m: Mapping[str, float]) -> str:
    """One line for RL step `step` (0-based, as everywhere: `step 0 of 2` is the first) of a run of `num_steps`
    steps: reward, held-out accuracy (evaluated steps only), step time | device-seconds per phase and the weight
    sync | the step's reshards and migrations with their seconds."""
    heldout = f"  held-out {m['eval/heldout_accuracy']:.3f}" if "eval/heldout_accuracy" in m else ""
    phases = "  ".join(f"{what} {m.get(f'phase/{role}_device_s', 0.0):.2f}" for role, what in PHASES)
    return (f"step {step} of {num_steps}  reward {m.get('grpo/reward_mean', 0.0):.3f}{heldout}  "
            f"{m['step/time_s']:.2f} s | {phases} device-s  sync {m.get('sync/time_s', 0.0):.2f} s | "
            f"{_plural(m.get('reshard/count', 0), 'reshard')} {m.get('reshard/total_s', 0.0):.2f} s  "
            f"{_plural(m.get('migration/count', 0), 'migration')} {m.get('migration/total_s', 0.0):.2f} s")


def progress_percent(steps_done: int, num_steps: int) -> float:
    """Percent of the run's steps done (a progress artifact's value, 0 to 100)."""
    return 100.0 if num_steps <= 0 else round(100.0 * min(max(steps_done, 0), num_steps) / num_steps, 2)


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in an MLflow UI at `tracking_uri` (a tracking server's address), in the model-training view
    (`tidal.tracking.ui_run_url`)."""
    return ui_run_url(tracking_uri, experiment_id, run_id)


def mlflow_run_markdown(tracking_uri: str | None, experiment_id: str | None, run_id: str | None) -> str:
    """Where the run's MLflow record is: a link for a tracking server; for a local store (sqlite:///, a folder)
    the run id and the `mlflow ui` command that serves the store, with the page's address there."""
    if not run_id or tracking_uri is None or experiment_id is None:
        return "MLflow: not tracked (`track: false`)."
    uri = redact(tracking_uri)
    if tracking_uri.startswith(("http://", "https://")):
        url = mlflow_run_url(uri, experiment_id, run_id)
        return f"MLflow run: [{run_id}]({url})"
    url = mlflow_run_url(MLFLOW_UI, experiment_id, run_id)
    return (f"MLflow run `{run_id}` (experiment {experiment_id}) in the local store `{uri}`: serve it with "
            f"`mlflow ui --backend-store-uri {uri} --host 127.0.0.1` (or `tidal up`) and open [{url}]({url})")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def summary_markdown(summary: Mapping[str, Any], mlflow: str) -> str:
    """The run summary (`RunSummary.to_json()`) as a markdown table, then `mlflow` (`mlflow_run_markdown`)."""
    steps_s = [float(x) for x in summary.get("step_seconds", [])]
    rewards = [float(x) for x in summary.get("reward_per_step", [])]
    phase = summary.get("phase_seconds", {})
    named = dict(PHASES)
    order = [k for k in named if k in phase] + sorted(k for k in phase if k not in named)   # a step's order first
    rows = [
        ("policy", summary.get("policy", "")),
        ("steps", summary.get("steps", len(steps_s))),
        ("wall", f"{float(summary.get('wall_s', 0.0)):.1f} s"),
        ("mean step", f"{sum(steps_s) / len(steps_s):.2f} s" if steps_s else "-"),
        ("reward, final", f"{rewards[-1]:.3f} (first step {rewards[0]:.3f})" if rewards else "-"),
        ("held-out accuracy", f"{float(summary.get('eval_accuracy_start', 0.0)):.3f} -> "
                              f"{float(summary.get('eval_accuracy_end', 0.0)):.3f}"),
        ("time per phase (device-s)", ", ".join(f"{named.get(k, k)} {float(phase[k]):.1f}" for k in order) or "-"),
        ("device idle fraction", f"{float(summary.get('device_idle_fraction', 0.0)):.2f}"),
        ("reshards", summary.get("reshards", 0)),
        ("migrations", summary.get("migrations", 0)),
        *((f"warning: {w.get('kind', '')}", w.get("message", "")) for w in summary.get("warnings", [])),
        ("output", f"`{summary.get('output_dir', '')}`"),
    ]
    table = "\n".join(f"| {_cell(k)} | {_cell(v)} |" for k, v in rows)
    return f"# {_cell(summary.get('name', 'run'))}\n\n| what | value |\n|---|---|\n{table}\n\n{mlflow}\n"
