"""`tidal simulate CONFIG [--policy P] [--devices N] [--steps S] [--costs PRESET] [--json PATH]`.

CONFIG is a Tidal config (YAML) or `rlinf-example` (RLinf's 8-GPU example workload, built in). With
`--devices N` the RLinf example placement (actor 1/4, rollout 1/2, inference 1/4) scales to N devices.
`--policy all` compares static, rlinf and tidal on the same seed. `--costs` picks a cost preset
(`scheduler.costs.PRESETS`): `gpu` (derived), `gpu_h200` (fitted to measurements on one H200), `cpu`.
"""

from __future__ import annotations

import argparse
import json
from argparse import Namespace
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from scheduler.costs import PRESETS, preset
from scheduler.policies import POLICIES
from scheduler.simulator import SimResult, simulate
from scheduler.workload import SimSpec, rlinf_example
from tidal.core.config import load_config
from tidal.core.errors import TidalError


def _spec(config: str, devices: int | None, costs: str | None = None) -> SimSpec:
    model = preset(costs) if costs else None
    if config == "rlinf-example":
        return rlinf_example(devices or 8, costs=model)
    spec = SimSpec.from_config(load_config(config), devices)
    return replace(spec, costs=model) if model else spec


def cli_simulate(args: Namespace) -> int:
    """args: config (path or `rlinf-example`), policy (name, `all` or None), devices, steps, seed, json."""
    spec = _spec(args.config, getattr(args, "devices", None), getattr(args, "costs", None))
    pol = getattr(args, "policy", None)
    if pol is None and args.config != "rlinf-example":
        pol = load_config(args.config).scheduler.policy
    names = list(POLICIES) if pol == "all" else [pol or "tidal"]
    for n in names:
        if n not in POLICIES:
            raise TidalError("--policy", n, "unknown policy", f"use one of {sorted(POLICIES)} or all")
    steps = getattr(args, "steps", None) or 10
    seed = getattr(args, "seed", None) or 0
    results: list[SimResult] = [simulate(spec, n, None, steps, seed) for n in names]
    base = next((r for r in results if r.policy == "static"), None)
    table = Table(title=f"simulated {spec.name}: {spec.num_devices} devices, {steps} steps, seed {seed}, "
                        f"costs {spec.costs.name}")
    for col in ("policy", "mean step s", "vs static", "idle", "migrations", "reshards", "sim wall s"):
        table.add_column(col, justify="right")
    for r in results:
        speed = f"{base.mean_step_s / r.mean_step_s:.2f}x" if base else "-"
        table.add_row(r.policy, f"{r.mean_step_s:.1f}", speed, f"{r.idle_fraction:.1%}",
                      str(sum(s.migrations for s in r.steps)), str(sum(s.reshards for s in r.steps)),
                      f"{r.sim_wall_s:.2f}")
    Console().print(table)
    out = getattr(args, "json", None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps([r.to_json() for r in results], indent=1))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tidal simulate",
                                 description="Discrete-event simulation of a run's scheduling (same policy code).")
    ap.add_argument("config", help="Tidal config YAML, or `rlinf-example` (RLinf's 8-GPU workload, built in)")
    ap.add_argument("--policy", default=None, help=f"one of {sorted(POLICIES)} or `all` (default: the config's)")
    ap.add_argument("--devices", type=int, default=None, help="scale the placement to N devices")
    ap.add_argument("--steps", type=int, default=10, help="RL steps to simulate")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--costs", default=None, choices=sorted(PRESETS),
                    help="cost preset (default: gpu for rlinf-example; a config's cluster.device picks cpu or gpu)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    if args.devices is not None and args.devices < 4:
        raise TidalError("--devices", args.devices, "is too small for actor, rollout and inference", "use >= 4")
    return cli_simulate(args)
