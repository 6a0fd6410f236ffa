"""Prefect tasks: verbs that call library code and pass ids, paths and small typed values, never tensors.

`training` (a run's steps), `sweep` (Optuna trials), `benchmark` (simulated policies); plain helpers:
`requests` (typed flow parameters), `registry` (live objects of this process by key), `tidal.pipeline.tracked_run` (MLflow +
database wiring of a run). See docs/flows.md.
"""
