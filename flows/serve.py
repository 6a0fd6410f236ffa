"""`tidal serve [--limit N] [--only NAME ...]`: register Tidal's flows as deployments and run them on demand.

    tidal up && source .tidal/services/env      # a Prefect server on 127.0.0.1:4200 (or compose's)
    tidal serve                                 # deployments rl-training/rl-training, policy-sweep/policy-sweep,
                                                #             benchmark/benchmark; Ctrl-C stops serving
    prefect deployment run rl-training/rl-training -p request='{"config": "experiments/rlinf_dynamic.yaml",
                                                               "policy": "rlinf", "num_steps": 2}'
    curl -X POST $PREFECT_API_URL/deployments/<id>/create_flow_run -H 'content-type: application/json' \
         -d '{"parameters": {"request": {"overrides": ["run.num_steps=2"]}}}'

This is Prefect's `flow.serve` for several flows at once (`prefect.serve` over `flow.to_deployment`): the
process polls the server for runs of its deployments and runs each in a subprocess of its own, in the
directory `tidal serve` was started in (config paths are relative to it). Parameters are checked against
each flow's schema by the server (`enforce_parameter_schema`), so a bad request is refused when made.

Serving needs a server someone else can reach: with no `PREFECT_API_URL` Prefect would start a temporary
one inside this process, so that is refused with the fix. (Flows themselves run fine without a server:
`python -c "from flows.rl_training import rl_training; rl_training()"`.)
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from tidal.core.errors import TidalError

if TYPE_CHECKING:
    from prefect import Flow

TELEMETRY_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true",
                 "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0"}
NAMES = ("rl-training", "policy-sweep", "benchmark")


def deployments(only: tuple[str, ...] = NAMES) -> list:
    """The RunnerDeployments `tidal serve` registers (one per flow, named like the flow)."""
    from prefect.deployments.runner import EntrypointType

    from flows.benchmark import benchmark
    from flows.policy_sweep import policy_sweep
    from flows.rl_training import rl_training
    flows: dict[str, Flow[..., Any]] = {"rl-training": rl_training, "policy-sweep": policy_sweep,
                                        "benchmark": benchmark}
    return [flows[n].to_deployment(name=n, tags=["tidal"], description=(flows[n].description or "").strip(),
                                   entrypoint_type=EntrypointType.MODULE_PATH) for n in only]


def _names(text: str) -> str:
    if text not in NAMES:
        raise argparse.ArgumentTypeError(f"unknown flow {text!r}: use one of {', '.join(NAMES)}")
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tidal serve", description="Serve Tidal's flows as Prefect deployments.")
    ap.add_argument("--limit", type=int, default=1,
                    help="runs at once (default 1: a training run uses every device of the machine)")
    ap.add_argument("--only", type=_names, nargs="+", default=list(NAMES), metavar="FLOW",
                    help=f"serve only these flows ({', '.join(NAMES)})")
    args = ap.parse_args(argv)
    if args.limit < 1:
        raise TidalError("--limit", args.limit, "must be at least 1", "e.g. --limit 1")
    for k, v in TELEMETRY_ENV.items():
        os.environ.setdefault(k, v)
    if not os.environ.get("PREFECT_API_URL"):
        raise TidalError("PREFECT_API_URL", "(unset)", "serving needs a Prefect server to register with",
                         "run `tidal up` then `source .tidal/services/env`, or export "
                         "PREFECT_API_URL=http://127.0.0.1:4200/api")
    from prefect import serve
    serve(*deployments(tuple(args.only)), limit=args.limit)
    return 0
