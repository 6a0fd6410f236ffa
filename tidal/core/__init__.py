"""The core every other package may import: user errors, placements, the run configuration, device ownership.

- `errors`     `TidalError(field, value, problem, fix)` (exit code 2) and its kinds `ConfigError`, `LayoutError`;
- `placement`  RLinf's `component_placement` syntax -> `Placement` (device ids per component) and its `Mode`;
- `config`     `TidalConfig` (typed sections), `load_config(path, overrides)`, `build_config`, `flatten`;
- `config_doc` docs/config.md, the configuration reference, generated from the field descriptions;
- `devices`    `DeviceLedger`: who owns each device (`Owner`), the allowed moves and their history.

Imports: nothing outside the core, and no torch, Ray or orchestration library: `errors` imports nothing,
`placement` imports `errors`, `config` both (plus pydantic and PyYAML), `devices` the standard library only.

Invariants:
- bad user input (a config key, a flag, a file) is a `TidalError` naming the field, the value and the fix;
- every config default is defined once, in `config`; sections refuse unknown keys, infinities and NaN, and are
  frozen once built; RLinf's `cluster:` keys are accepted as RLinf spells them; YAML is read with
  `yaml.safe_load` only;
- a device is never in two roles: between owners it is `MOVING` and nobody can take it (`DeviceLedger`).
"""
