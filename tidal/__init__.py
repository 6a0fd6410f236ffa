"""Tidal: RL post-training of LLMs with dynamic scheduling.

Import names are folder paths. This package holds the system's own layers; the platform's Prefect and database
layers are the top-level packages `scheduler`, `tasks`, `flows` and `db`. Bottom to top (each may import only
what is below it; `tests/test_boundaries.py` holds the table):

- `tidal.core`      errors, placements, the run configuration, device ownership (no torch, no orchestration);
- `tidal.engine`    torch only: the decoder, TP, ZeRO-1 AdamW, resharding, checkpoints, generation, GRPO;
- `tidal.workers`   one Ray actor per device over one torch.distributed world, and the roles they play;
- `scheduler`       pure decisions over typed records: observe -> decide -> reconcile, costs, the simulator;
- `db`              SQLAlchemy + Alembic: runs, steps, device moves, scheduler events;
- `tidal.tracking`  the one metrics sink (MLflow);
- `tidal.pipeline`  the RL step driver: rollout -> inference -> actor on the workers, the control loop;
- `tidal.sweep`     Optuna sweeps of the scheduler's settings;
- `tasks`, `flows`  Prefect tasks (verbs) and flows (one flow run = one training run);
- `tidal.convert`   other frameworks' configs (RLinf) -> Tidal configs;
- `tidal.cli`       the entry points (`tidal`), which may import everything.

Invariants:
- bad user input is a `TidalError` naming the field, the value and the fix; the CLI prints it as one line on
  stderr and exits 2, never with a traceback;
- `tidal.tracking` is the only module that imports mlflow: components return metric dicts and event records;
- an import inside a function exists only to keep a heavy dependency out of a module that otherwise does
  without it (e.g. `tidal --help` loads neither torch nor Ray).
"""
