"""tasks: Prefect tasks, the verbs the flows call. Each calls library code and passes ids, paths and small
typed values, never tensors or worker handles (Prefect pickles results). See docs/flows.md.

Entry points:
- `training`: `open_run` (config, database row, MLflow run, warm start, workers; returns an `OpenedRun` with
  its key), `run_step`, `sync_weights`, `evaluate`, `record_step`, `checkpoint`, `finish_run`, `close_run`: verbs
  over a `tidal.pipeline.run.TrainingRun` (tracking wired by `tidal.pipeline.tracked_run`); `report_step`,
  `report_run` (plain functions the flow calls: a log line per step, the progress and summary artifacts);
- `sweep`: `open_sweep`, `ask_trial`, `run_trial`, `report_sweep`, `close_sweep` over a `tidal.sweep.Sweep`;
- `benchmark`: `simulate_policy` (one policy on the simulator), `write_comparison`;
- plain code: `requests` (`TrainingRequest`, `SweepRequest`, `BenchmarkRequest`: the flows' typed, validated
  parameters, a config path plus `key.path=value` overrides as on the command line; `TrainingRequest`'s typed
  fields become overrides too), `reporting` (pure: the step line, artifact keys, the summary markdown and the
  MLflow run's address) and `registry` (`put`, `get`, `pop`: the live objects of this process by short string
  key).

Imports: Prefect, pydantic, `tidal.pipeline` (the run and its tracking), `scheduler` (the simulator, for
`benchmark`), `tidal.sweep`, `tidal.core.errors` and itself; never the engine or workers directly, never `flows`.

Invariants:
- the objects a task acts on (a `TrainingRun` holding its Ray workers, a `Sweep`) live in the flow run's process,
  in `registry`; tasks get their key, and a key from another process is refused, not resolved to something else;
- every task has `cache_policy=NO_CACHE`: each acts on live workers or studies and must run every time;
- `run_step` refuses a step out of order: a run's steps run once each, in order;
- a request's paths are resolved by the process that runs the flow; a bad config is a `TidalError` when the flow
  loads it.
"""
