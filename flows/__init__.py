"""flows: Tidal's Prefect flows. They are thin and read like the algorithm; the work is in `tasks` and
library code. See docs/flows.md.

Entry points (each takes one typed request from `tasks.requests`, which the Prefect UI renders as a form):
- `rl_training.rl_training(TrainingRequest)`: flow `rl-training`, one flow run = one training run, each RL step a
  subflow run `rl-step` named step-N (run_step -> sync_weights -> evaluate if due -> record_step -> checkpoint if
  due), the loop `tidal.pipeline.run_loop.run_loop` that `tidal train` drives too (recovery, resume from a
  checkpoint: `TrainingRequest.resume_from`); `tidal train --flow` runs it;
- `policy_sweep.policy_sweep(SweepRequest)`: flow `policy-sweep`, an Optuna study of scheduler settings
  (`tidal.sweep`), trial after trial, on the simulator or real runs;
- `benchmark.benchmark(BenchmarkRequest)`: flow `benchmark`, scheduler policies simulated side by side on one
  workload, optionally trained for real one after another (an `rl-training` subflow each);
- `serve`: `tidal serve`, the three flows as deployments of the same names on a Prefect server.

Imports: Prefect, `tasks.*`, `tidal.core.errors` and itself; the library is reached through the tasks.

Invariants:
- a flow only orders tasks and subflows; what crosses a task boundary is an id, a path or a small typed value,
  never a tensor or a worker handle (Prefect pickles results);
- the flows run with or without a Prefect server; `tidal serve` refuses to run without `PREFECT_API_URL` (it
  would serve from a temporary in-process server), and the server checks every request against the flow's
  parameter schema before a run starts;
- `rl-training` always closes its run: the workers go down and the MLflow run and database row end as
  FINISHED, FAILED or KILLED, whatever happens in its steps.
"""
