"""Tidal's Prefect flows: thin, read like the algorithm; the work is in `tidal.tasks` and library code.

- `rl_training`: one flow run = one training run, each RL step a subflow run (`rl-step`, named step-N);
- `policy_sweep`: an Optuna study of scheduler settings (`tidal.sweep`), on the simulator or real runs;
- `benchmark`: scheduler policies compared on one workload;
- `serve`: `tidal serve`, the three as deployments on a Prefect server. See docs/flows.md.
"""
