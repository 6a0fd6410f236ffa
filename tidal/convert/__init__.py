"""Configs of other frameworks, turned into Tidal configs: `tidal convert rlinf FILE` (`rlinf.convert`).

- `rlinf`          the command, `convert(doc) -> Conversion` and `convert_file` (the Tidal mapping, what was
                   carried, what was dropped and why);
- `interpolation`  RLinf's `${...}` references, resolved by OmegaConf with RLinf's resolvers registered;
- `builder`        the state of one conversion and its checked readers;
- `mapping`        the RLinf -> Tidal key mapping, one step per Tidal section;
- `keys`           RLinf keys Tidal knows but does not carry, each with its reason.

Imports: the core and OmegaConf only. Invariants: the file is read with `yaml.safe_load`; every leaf is either
carried (checked and converted) or reported with a reason; the output is a config `tidal validate` accepts.
"""
