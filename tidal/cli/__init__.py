"""The entry points: the `tidal` command (`main`, installed as `tidal.cli.main:main`) and the sub-commands that
put the packages together.

- `main`           dispatch, `tidal validate` and `tidal convert`; every other sub-command is imported when it runs,
                   so `tidal --help` and a bad flag stay cheap;
- `train`          `tidal train CONFIG`: the main job (a Prefect flow run, or the pipeline directly);
- `services`       `tidal up` / `tidal down`: Prefect, MLflow and optuna-dashboard, bound to 127.0.0.1 unless
                   `--host` says otherwise;
- `model_check`    `tidal model check DIR`: a Hugging Face checkpoint's family, sizes and logit parity;
- `reshard_check`  `tidal reshard-check`: reshard an actor between two layouts and verify every byte;
- `compare`        `tidal compare`: MLflow runs side by side, or grouped by policy or by sweep.

The other sub-commands live with their code: `tidal sweep` (`tidal.sweep`),
`tidal simulate` (`scheduler.sim_cli`), `tidal serve` (`flows.serve`), `tidal warm-start`
(`tidal.pipeline.task_checkpoint`).

Imports: any package. Invariant: a user error prints one line on stderr naming the field, the value and the fix,
and exits 2, never with a traceback.
"""
