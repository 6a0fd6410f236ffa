"""`tidal plan`: predicted step time and device use of every placement and policy, and the one to run.

    tidal plan CONFIG [--devices N] [--lengths FILE] [--steps S] [--json PATH]
    tidal plan --workload longtail --model 7b --devices 64 [--lengths FILE] ...
    tidal plan --from-run RUN_DIR [--costs PRESET] [--json PATH]

With CONFIG, the model shape is the config's (a Hugging Face checkpoint's `config.json`, or Tidal's own model's
fields), the batch, TPs and slots are the config's, and the costs are the measured GPU figures scaled to the
shape (`model_costs.costs_for`), or the CPU preset for `cluster.device: cpu`. Without it, a built-in workload
(`catalog.WORKLOADS`) on a built-in shape. `--lengths` replaces the length distribution with measured response
lengths (a JSON list, a list of groups, or a finished run's folder: every group it generated).

Every baseline is scored at its best on seed 0's draws (`baselines.baselines`); the recommendation is
`planner.plan`'s, made on other draws of the same workload, and its row is scored on seed 0 too.

`--from-run` predicts every step of a finished run from its own response lengths, phase by phase, and prints the
prediction beside what the run measured (`from_run.py`); `--costs` names the cost preset (default: the fitted GPU
preset `gpu_h200` for a GPU run, `cpu` for CPU devices), scaled to the run's model shape.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from scheduler import from_run
from scheduler.baselines import baselines, default_split, with_split
from scheduler.bounds import step_bound
from scheduler.catalog import CLUSTERS, MODELS, WORKLOADS
from scheduler.catalog import spec as catalog_spec
from scheduler.costs import PRESETS, preset
from scheduler.model_costs import ModelShape, costs_for
from scheduler.phased import minibatch_ready, step_lengths
from scheduler.planner import plan, run_candidate
from scheduler.workload import EmpiricalLengths, SimSpec
from tidal.core.config import TidalConfig, load_config
from tidal.core.errors import TidalError


def shape_of(cfg: TidalConfig) -> ModelShape:
    """The model shape of a config: the checkpoint's `config.json` when `model.path` is set, else Tidal's own."""
    m = cfg.model
    if m.path:
        path = Path(m.path) / "config.json"
        try:
            hf = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TidalError("model.path", m.path, f"has no readable config.json ({e})",
                             "point model.path at a Hugging Face checkpoint directory") from None
        heads = int(hf["num_attention_heads"])
        dims = {"hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"], "num_heads": heads,
                "num_kv_heads": hf.get("num_key_value_heads", heads), "intermediate_size": hf["intermediate_size"],
                "vocab_size": hf["vocab_size"], "tie_embeddings": hf.get("tie_word_embeddings", False),
                "head_dim": hf.get("head_dim", 0)}
    else:
        dims = {"hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
                "num_kv_heads": m.num_kv_heads, "intermediate_size": m.intermediate_size,
                "vocab_size": m.vocab_size or 32_000, "tie_embeddings": m.tie_embeddings}
    return from_run.shape_of(dims, cfg)


def spec_of(args: argparse.Namespace) -> SimSpec:
    lengths = EmpiricalLengths.from_file(args.lengths) if args.lengths else None
    if args.config:
        cfg = load_config(args.config)
        s = SimSpec.from_config(cfg, args.devices)
        p = s.params
        if len({*p.actor_devices, *p.rollout_devices, *p.inference_devices}) < (
                len(p.actor_devices) + len(p.rollout_devices) + len(p.inference_devices)):
            s = with_split(s, default_split(s))   # a shared placement: the disaggregated arms start from RLinf's
        if lengths:
            s = replace(s, lengths=lengths)
        if cfg.cluster.device != "cpu":
            m = shape_of(cfg)
            s = replace(s, costs=costs_for(m, s.prompt_tokens + s.lengths.median / 2),
                        params=replace(s.params, min_actor_devices=m.min_actor_devices))
        return s
    if not (args.workload and args.model and args.devices):
        raise TidalError("CONFIG", None, "no config and no built-in workload given",
                         f"give a config file, or --workload ({', '.join(WORKLOADS)}), --model "
                         f"({', '.join(MODELS)}) and --devices (e.g. {', '.join(map(str, CLUSTERS))})")
    return catalog_spec(args.workload, args.model, args.devices, lengths)


def report(s: SimSpec, steps: int) -> dict:
    """Every baseline at its best and tidal's plan, on seed 0's draws of `s`."""
    arms, _ = baselines(s, steps, 0)
    pl = plan(s, steps)
    tidal = run_candidate(s, pl.chosen, steps, 0)
    rows: dict[str, dict] = {k: {"placement": a.placement, "policy": a.policy, "step_s": a.mean_step_s,
                                 "idle_fraction": a.result.idle_fraction} for k, a in arms.items()}
    rows["tidal"] = {"placement": pl.chosen.placement, "policy": pl.chosen.policy, "step_s": tidal.mean_step_s,
                     "idle_fraction": tidal.idle_fraction}
    best = min(arms, key=lambda k: arms[k].mean_step_s)
    bound = sum(step_bound(s, step_lengths(s, 0, k)) for k in range(steps)) / steps
    for r in rows.values():
        r["tidal_speedup"] = r["step_s"] / tidal.mean_step_s
    return {"spec": s.name, "devices": s.num_devices, "costs": s.costs.name, "steps": steps,
            "prompts": s.params.rollout_batch_size, "group_size": s.params.group_size,
            "max_new_tokens": s.max_new_tokens, "arms": rows, "best_baseline": best,
            "tidal_vs_best_baseline": arms[best].mean_step_s / tidal.mean_step_s, "plan": pl.to_json(),
            "minibatch_ready_fraction": minibatch_ready(s, step_lengths(s, 0, 0), s.num_devices),
            "bound_s": bound, "collocated_over_bound": arms["collocated"].mean_step_s / bound}


def from_run_main(args: argparse.Namespace) -> int:
    rec = from_run.load(args.from_run)
    name = args.costs or ("cpu" if rec.device_kind == "cpu" else "gpu_h200")
    rep = from_run.predict(rec, preset(name), learn=args.learned)
    phases = list(rep["steps"][0]["predicted"]) if rep["steps"] else []
    t = Table(title=f"{rep['run']}: {rep['placement']} placement, costs {rep['costs']}: predicted / measured s")
    t.add_column("step", justify="right")
    for ph in phases:
        t.add_column(ph, justify="right")
    for row in rep["steps"]:
        t.add_row(str(row["step"]), *(f"{row['predicted'][ph]:.2f} / {row['measured'][ph]:.2f} "
                                      f"({row['ratio'][ph]:.2f}x)" if row["ratio"][ph] is not None else "-"
                                      for ph in phases))
    con = Console(width=max(100, Console().width))
    con.print(t)
    con.print(f"largest relative error: {rep['worst_relative_error']:.1%}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tidal plan", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=None, help="Tidal config YAML (or use --workload and --model)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default=None, help="a built-in workload")
    ap.add_argument("--model", choices=MODELS, default=None, help="a built-in model shape")
    ap.add_argument("--devices", type=int, default=None, help="cluster size (default: the config's)")
    ap.add_argument("--lengths", default=None, metavar="FILE",
                    help="measured response lengths: a JSON file, or a finished run's folder (its steps.json)")
    ap.add_argument("--steps", type=int, default=2, help="simulated steps per arm")
    ap.add_argument("--from-run", default=None, metavar="DIR", help="a finished run's folder: predicted vs measured")
    ap.add_argument("--costs", default=None, choices=sorted(PRESETS), help="cost preset for --from-run")
    ap.add_argument("--learned", action="store_true",
                    help="--from-run: predict each step with what the run learned by the end of the one before")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    args = ap.parse_args(argv)
    if args.from_run:
        return from_run_main(args)
    if args.steps < 1:
        raise TidalError("--steps", args.steps, "must be at least 1", "e.g. --steps 2")
    rep = report(spec_of(args), args.steps)
    t = Table(title=f"{rep['spec']}: {rep['devices']} devices, {rep['prompts']} prompts x {rep['group_size']}, "
                    f"costs {rep['costs']}")
    for col in ("arm", "placement", "policy", "step s", "tidal speedup", "idle"):
        t.add_column(col, justify="right")
    for name, r in rep["arms"].items():
        t.add_row(name, r["placement"], r["policy"], f"{r['step_s']:.1f}", f"{r['tidal_speedup']:.2f}x",
                  f"{r['idle_fraction']:.0%}" if math.isfinite(r["idle_fraction"]) else "-")
    con = Console(width=max(100, Console().width))
    con.print(t)
    con.print(f"recommended: {rep['plan']['reason']}")
    ready = ", ".join(f"{x:.0%}" for x in rep["minibatch_ready_fraction"])
    con.print(f"mini-batches generated (collocated rollout, id order) at {ready} of the rollout; no schedule that "
              f"trains what the static run trains beats {rep['bound_s']:.1f} s a step "
              f"(collocated / bound {rep['collocated_over_bound']:.2f}x)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1))
    return 0
