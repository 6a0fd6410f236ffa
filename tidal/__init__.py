"""Tidal: RL post-training of LLMs with dynamic scheduling. This folder is the package root: the core that every
other package may import, and the entry points that put the packages together.

Core:
- `errors`     `TidalError(field, value, problem, fix)` (exit code 2) and its kinds `ConfigError`, `LayoutError`;
- `placement`  RLinf's `component_placement` syntax -> `Placement` (device ids per component) and its `Mode`;
- `config`     `TidalConfig` (typed sections), `load_config(path, overrides)`, `build_config`, `flatten`;
- `devices`    `DeviceLedger`: who owns each device (`Owner`), the allowed moves and their history.

Entry points: `cli` (`tidal`, `tidal.cli:main`: `validate`, `convert` and every sub-command whose module is
installed), `train` (`tidal train`), `sweep` (`tidal sweep`), `services` (`tidal up` / `tidal down`),
`tracking` (`MetricsSink`: `MlflowSink`, `NullSink`; `tidal compare`), `model_check` (`tidal model check`),
`reshard_check` (`tidal reshard-check`), `convert_rlinf*` (`tidal convert rlinf`), `config_doc` (README's
configuration table from the field descriptions). `tidal.pipeline` (the RL step driver) lives here too; the
other top-level folders are `tidal.engine`, `tidal.workers`, `tidal.scheduler`, `tidal.db`, `tidal.flows` and
`tidal.tasks` (pyproject.toml's package-dir).

Imports:
- the core imports nothing outside the core, and no torch, Ray or orchestration library: `errors` imports nothing,
  `placement` imports `errors`, `config` both (plus pydantic and PyYAML), `devices` the standard library only;
- `convert_rlinf*` and `config_doc` import only the core (and OmegaConf for RLinf's interpolations);
- the entry points may import any package; `cli` imports a sub-command's module only when it runs, and `train`,
  `sweep`, `services`, `tracking` import the pipeline, Ray, Prefect, MLflow and Optuna inside the functions
  that use them, so `tidal --help` and a bad flag stay cheap.

Invariants:
- bad user input (a config key, a flag, a file) is a `TidalError` naming the field, the value and the fix; the
  CLI prints it as one line on stderr and exits 2, never with a traceback;
- every config default is defined once, in `tidal.config`; sections refuse unknown keys and are frozen once
  built; RLinf's `cluster:` keys are accepted as RLinf spells them; YAML is read with `yaml.safe_load` only;
- `tidal.tracking` is the only module that imports mlflow: components return metric dicts and event records;
- a device is never in two roles: between owners it is `MOVING` and nobody can take it (`DeviceLedger`);
- the services `tidal up` starts bind 127.0.0.1 unless `--host` says otherwise.
"""
