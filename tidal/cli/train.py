"""`tidal train CONFIG [key=value ...] [--json PATH] [--no-track] [--resume DIR] [--flow]`: the main job.

Runs an RL training job (GRPO) on the config's placement: CPU virtual devices unless the machine has enough
GPUs. Prints a live progress line per step and a final summary; writes the run's folder (timeline.png,
summary.json, events.json); logs to MLflow (`tracking.mlflow_uri`, local sqlite by default) and the platform
database (`tracking.db_url`). `--resume DIR` goes on from a checkpoint folder's newest generation; `--flow` runs
the same loop (`tidal.pipeline.run_loop`) as the Prefect `rl-training` flow, `--resume` as its `resume_from`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from tasks.requests import TrainingRequest
from tidal.core.config import TidalConfig
from tidal.core.errors import ConfigError
from tidal.pipeline.tracked_run import RunTracking, closing_status, load_run_config, policy_name, run_dir
from tidal.workers.errors import WorkerError

if TYPE_CHECKING:
    from tidal.pipeline.run import RunSummary


def _spark(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return "".join(bars[int((v - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for v in values)


def _source(cfg: TidalConfig) -> str:
    model = f"model {cfg.model.path}" if cfg.model.path else "Tidal's own model"
    data = f"prompts {', '.join(cfg.data.train_files)}" if cfg.data.train_files else f"task {cfg.data.task}"
    return f"{model}, {data}"


def check_json_path(path: str | None) -> None:
    """`--json PATH` can be written when the run ends: refused before it starts, not after it trained."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError("--json", path, "is a folder", f"name a file, e.g. {p / 'summary.json'}")
    parent = next((q for q in p.parents if q.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("--json", path, f"cannot be written: {parent} is not a writable folder",
                          "name a file in a folder this user can write")


def _write_json(path: str | None, obj: object) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=1, default=str))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tidal train", description="Run an RL training job from a config.")
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key.path=value overrides")
    ap.add_argument("--json", metavar="PATH", help="write the run summary as JSON")
    ap.add_argument("--no-track", action="store_true", help="skip MLflow and the database")
    ap.add_argument("--flow", action="store_true",
                    help="run it as the Prefect `rl-training` flow (a temporary local Prefect server when "
                         "PREFECT_API_URL is unset; each step a subflow run)")
    ap.add_argument("--resume", metavar="DIR", help="resume from a checkpoint directory (its newest complete "
                    "generation; the layout may differ); with --flow, the flow's resume_from")
    return ap


def _already_finished(args: argparse.Namespace, cfg: TidalConfig, console: Console) -> bool:
    """`--resume` of a checkpoint at or past `run.num_steps`: nothing to do, and that is success (said, and the
    JSON written)."""
    if not args.resume:
        return False
    from tidal.pipeline.checkpointing import saved_step
    gen, step = saved_step(args.resume)
    if step < cfg.run.num_steps:
        return False
    console.print(f"[bold]tidal train[/]: the checkpoint {gen} is at step {step} of run.num_steps="
                  f"{cfg.run.num_steps}: the run is finished (raise run.num_steps to train on)")
    _write_json(args.json, {"status": "finished", "checkpoint": str(gen), "step": step,
                            "num_steps": cfg.run.num_steps})
    return True


def _print_start(args: argparse.Namespace, cfg: TidalConfig, out_dir: Path, console: Console) -> None:
    console.print(f"[bold]tidal train[/] {args.config}: {cfg.placement.mode.value} placement on "
                  f"{cfg.cluster.num_devices} devices, policy [bold]{policy_name(cfg)}[/], {cfg.run.num_steps} steps, "
                  f"{_source(cfg)}; output {out_dir}")
    where = ("the machine" if cfg.cluster.cpu_device_cores is None
             else f"cores {cfg.cluster.cpu_device_cores} (devices pinned there)")
    if cfg.cluster.cpu_compute_share:
        console.print(f"CPU virtual devices capped at {cfg.cluster.cpu_compute_share:.3f} of {where} each "
                      "(fixed compute share: idle capacity is lost, as on a GPU)")
    elif cfg.cluster.cpu_device_cores is not None:
        console.print(f"CPU virtual devices pinned to {where}")


def _step_line(step: int, num_steps: int, m: dict[str, float]) -> str:
    ev = f" heldout {m['eval/heldout_accuracy']:.3f}" if "eval/heldout_accuracy" in m else ""
    return (f"step {step + 1:>3}/{num_steps}  reward {m.get('grpo/reward_mean', 0):.3f}{ev}  "
            f"{m['step/time_s']:.1f}s  idle {m['step/idle_fraction']:.2f}  "
            f"actor {m.get('phase/actor_device_s', 0):.1f} rollout {m.get('phase/rollout_device_s', 0):.1f} "
            f"inference {m.get('phase/inference_device_s', 0):.1f} device-s")


def _print_summary(summary: RunSummary, cfg: TidalConfig, out_dir: Path, console: Console) -> None:
    t = Table(title=f"summary: {cfg.run.name}")
    t.add_column("what")
    t.add_column("value")
    t.add_row("steps, wall", f"{summary.steps}, {summary.wall_s:.1f} s")
    t.add_row("held-out accuracy", f"{summary.eval_accuracy_start:.3f} -> {summary.eval_accuracy_end:.3f}")
    t.add_row("reward curve", f"{_spark(summary.reward_per_step)}  "
                              f"({summary.reward_per_step[0]:.3f} -> {summary.reward_per_step[-1]:.3f})")
    t.add_row("time per phase (device-s)", ", ".join(f"{k} {v:.1f}" for k, v in summary.phase_seconds.items()))
    t.add_row("device idle fraction: whole run, steps only",   # run/idle_fraction, run/step_idle_fraction
              f"{summary.device_idle_fraction:.2f}, {summary.figures.get('run/step_idle_fraction', 0.0):.2f}")
    t.add_row("reshards, migrations", f"{summary.reshards}, {summary.migrations}")
    for w in summary.warnings:
        t.add_row(f"warning: {w['kind']}", w["message"])
    if "train" in summary.data:   # data files: what the length filter kept
        t.add_row("prompts kept, too long", ", ".join(f"{k} {v['kept']}, {v['too_long']}"
                                                      for k, v in summary.data.items() if isinstance(v, dict)))
    t.add_row("timeline", str(out_dir / "timeline.png"))
    console.print(t)


def _summary_json(summary: RunSummary) -> dict[str, object]:
    return {"steps": summary.steps, "wall_s": summary.wall_s, "eval_accuracy_start": summary.eval_accuracy_start,
            "eval_accuracy_end": summary.eval_accuracy_end, "reward_per_step": summary.reward_per_step,
            "phase_seconds": summary.phase_seconds, "device_idle_fraction": summary.device_idle_fraction,
            "policy": summary.policy, "step_seconds": summary.step_seconds, "reshards": summary.reshards,
            "migrations": summary.migrations, "final_weights_sha": summary.final_weights_sha,
            "data": summary.data, "warnings": summary.warnings, "restarts": summary.restarts,
            "figures": summary.figures}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    check_json_path(args.json)
    cfg = load_run_config(args.config, args.overrides)
    console = Console()
    if _already_finished(args, cfg, console):
        return 0
    if args.flow:
        from flows.rl_training import rl_training
        flow_summary = rl_training(TrainingRequest(config=args.config, overrides=list(args.overrides),
                                                   track=not args.no_track, resume_from=args.resume))
        _write_json(args.json, flow_summary)
        return 0
    for k, v in {"RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}.items():
        os.environ.setdefault(k, v)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tidal.pipeline.preflight import preflight
    checked = preflight(cfg, tracked=not args.no_track, resume_from=args.resume)   # before any folder or record
    out_dir = run_dir(cfg)
    _print_start(args, cfg, out_dir, console)
    from tidal.pipeline.run import run_training
    tracking = RunTracking.null(cfg) if args.no_track else RunTracking.open(cfg, out_dir)
    status = "FAILED"
    try:
        summary = run_training(cfg, out_dir, tracking.sink, tracking.recorder,
                               lambda step, m: console.print(_step_line(step, cfg.run.num_steps, m)),
                               resume_from=args.resume, checked=checked,
                               on_warning=lambda w: console.print(f"[yellow]warning:[/yellow] {w.message}"),
                               log_fn=lambda p: console.print(f"  warm start iter {p.iter}: loss {p.loss:.3f} "
                                                              f"held-out {p.heldout_accuracy:.3f}"))
        status = "FINISHED"
    except WorkerError as err:   # the machine failed the run, not its config: say how to continue it
        from tidal.engine.checkpoint import latest
        ckpt = out_dir / "checkpoints"
        hint = (f"continue it with `tidal train {args.config} --resume {ckpt}`" if latest(ckpt)
                else "no checkpoint was saved yet (run.checkpoint_every sets how often)")
        print(f"error: {err}; {hint}", file=sys.stderr)
        return 1
    except BaseException as stop:   # Ctrl-C, SIGTERM (`Terminated`): KILLED; any other error: FAILED
        status = closing_status(stop)
        raise
    finally:
        tracking.close(status, [out_dir / n for n in ("timeline.png", "summary.json", "events.json")])
    _print_summary(summary, cfg, out_dir, console)
    _write_json(args.json, _summary_json(summary))
    return 0
