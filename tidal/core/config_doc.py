"""docs/config.md, the configuration reference, generated from the config models' field descriptions.

    python -m tidal.core.config_doc                          # print the page
    python -m tidal.core.config_doc --write docs/config.md   # rewrite the page
    python -m tidal.core.config_doc --check docs/config.md   # exit 1 if the page differs from the code

The page is generated whole: a title, how a run is configured (a YAML file plus overrides), how RLinf's keys
are marked, then one table row per key. Nothing in it is written by hand, so the field descriptions in
`tidal.core.config` are its single source.

`config_rows(TidalConfig)` walks the models' fields recursively (a field whose type is a config model is a
section, its fields are dotted under it) and gives one row per leaf key: the dotted key, the default as a
YAML reader would write it (null, true/false, strings in backticks, collections in YAML flow style,
`default_factory` evaluated, enums by value) and the field's description. `config_table` renders them as a
markdown table; `config_page` puts the table under the page's title and introduction.
"""

from __future__ import annotations

import argparse
import enum
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tidal.core.config import TidalConfig

PAGE = "docs/config.md"
HEADER = ("| key | default | meaning |", "|---|---|---|")
REGENERATE = f"python -m tidal.core.config_doc --write {PAGE}"
INTRO = f"""\
# Configuration reference

A run is a YAML file plus `key.path=value` overrides (`tidal train CONFIG actor.lr=3e-4`); `tidal validate CONFIG
[key=value...]` checks one without running it. Unknown keys, impossible placements and sizes are errors that name
the key, the value and the fix (exit code 2).

The `cluster:` section takes RLinf's keys as RLinf spells them (`num_gpus_per_node` too), and `tidal convert rlinf
FILE` turns a whole RLinf experiment YAML into a Tidal config, naming on stderr each key it could not carry.
"(RLinf key)" below marks a key RLinf spells the same way, "(RLinf: x)" the RLinf key the converter carries into it.

This page is generated from the field descriptions in `tidal/core/config.py`: `{REGENERATE}`
rewrites it, and `tests/test_config_doc.py` fails when it differs from the code.
"""


@dataclass(frozen=True)
class Row:
    key: str            #: dotted key, e.g. "cluster.component_placement"
    default: str        #: rendered default
    description: str    #: the field's description ("" when it has none)


def _section(annotation: object) -> type[BaseModel] | None:
    """The config model a field's annotation names (a section), or None for a leaf."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def config_rows(model: type[BaseModel] | None = None, prefix: str = "") -> list[Row]:
    """One row per leaf field of `model` (default: TidalConfig), in declaration order."""
    if model is None:
        model = TidalConfig
    rows: list[Row] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section(field.annotation)
        if section is not None:
            rows.extend(config_rows(section, key + "."))
            continue
        if field.default is PydanticUndefined and field.default_factory is None:
            default = "required"
        else:
            default = render_default(field.get_default(call_default_factory=True))
        rows.append(Row(key, default, " ".join((field.description or "").split())))
    return rows


def _plain(value: object) -> object:
    """Tuples as lists, enums by value, recursively: what a YAML file would hold."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _float(value: float) -> str:
    if value != 0 and math.isfinite(value) and (abs(value) <= 1e-3 or abs(value) >= 1e6):
        mantissa, exp = f"{value:e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        text = f"{mantissa}e{int(exp)}"
        if float(text) == value:
            return text
    return repr(value)


def render_default(value: object) -> str:
    """A default as it reads in the table: `null`, `true`, `0.1`, `1e-4`, `` `auto` ``, `` `[0.9, 0.999]` ``."""
    value = _plain(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, (list, dict)):
        text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip()
        return f"`{text}`"
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_table(rows: list[Row] | None = None) -> str:
    """The markdown table (header, separator, one line per row), without a trailing newline."""
    rows = config_rows() if rows is None else rows
    lines = list(HEADER)
    lines += [f"| `{r.key}` | {_cell(r.default)} | {_cell(r.description)} |" for r in rows]
    return "\n".join(lines)


def config_page(rows: list[Row] | None = None) -> str:
    """The whole page: the introduction, then the table; ends with a newline."""
    return f"{INTRO}\n{config_table(rows)}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tidal.core.config_doc", description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", help=f"rewrite the page at PATH (the project's: {PAGE})")
    group.add_argument("--check", metavar="PATH", help="exit 1 if the page at PATH differs from the code")
    args = ap.parse_args(argv)
    page = config_page()
    if args.write is None and args.check is None:
        print(page, end="")
        return 0
    p = Path(args.write or args.check)
    current = p.read_text(encoding="utf-8") if p.is_file() else None
    if args.check is not None:
        if current != page:
            state = "is missing" if current is None else "differs from the code"
            print(f"{p} {state}; run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    if current != page:
        p.write_text(page, encoding="utf-8")
        print(f"{p}: written ({len(config_rows())} keys)")
    else:
        print(f"{p}: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
