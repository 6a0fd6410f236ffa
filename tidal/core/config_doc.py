"""README's configuration table, generated from the config models' field descriptions.

    python -m tidal.core.config_doc                     # print the table
    python -m tidal.core.config_doc --write README.md   # rewrite the table between the markers, nothing else
    python -m tidal.core.config_doc --check README.md   # exit 1 if the table there differs from the code

`config_rows(TidalConfig)` walks the models' fields recursively (a field whose type is a config model is a
section, its fields are dotted under it) and gives one row per leaf key: the dotted key, the default as a
YAML reader would write it (null, true/false, strings in backticks, collections in YAML flow style,
`default_factory` evaluated, enums by value) and the field's description. `config_table` renders them as a
markdown table; `replace_table` puts a table between `BEGIN` and `END` in a document.
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

BEGIN = "<!-- config-table:begin -->"
END = "<!-- config-table:end -->"
HEADER = ("| key | default | meaning |", "|---|---|---|")
REGENERATE = "python -m tidal.core.config_doc --write README.md"


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


def _span(text: str) -> tuple[int, int]:
    """Offsets of the text strictly between the markers; ValueError naming what is missing."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < 0 or end < start:
        raise ValueError(f"the document needs the markers {BEGIN} and {END}, in that order, around the table")
    if text.find(BEGIN, start + 1) >= 0 or text.find(END, end + 1) >= 0:
        raise ValueError(f"the markers {BEGIN} / {END} appear more than once")
    return start + len(BEGIN), end


def extract_table(text: str) -> str:
    """The table between the markers, stripped."""
    lo, hi = _span(text)
    return text[lo:hi].strip()


def replace_table(text: str, table: str) -> str:
    """`text` with the part between the markers replaced by `table` (everything else unchanged)."""
    lo, hi = _span(text)
    return f"{text[:lo]}\n{table}\n{text[hi:]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tidal.core.config_doc", description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", help="rewrite the table between the markers in PATH")
    group.add_argument("--check", metavar="PATH", help="exit 1 if PATH's table differs from the code")
    args = ap.parse_args(argv)
    table = config_table()
    path = args.write or args.check
    if path is None:
        print(table)
        return 0
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    try:
        current = extract_table(text)
    except ValueError as err:
        print(f"{path}: {err}", file=sys.stderr)
        return 2
    if args.check:
        if current != table:
            print(f"{path}'s config table differs from the code; run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    if current != table:
        p.write_text(replace_table(text, table), encoding="utf-8")
        print(f"{path}: config table rewritten ({table.count(chr(10)) - 1} rows)")
    else:
        print(f"{path}: config table up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
