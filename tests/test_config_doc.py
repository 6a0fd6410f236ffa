"""docs/config.md is generated from the config models (tidal.core.config_doc) and must match them."""

import enum
import re
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tidal.core.config import TidalConfig
from tidal.core.config_doc import (
    INTRO,
    PAGE,
    REGENERATE,
    Row,
    config_page,
    config_rows,
    config_table,
    main,
    render_default,
)

ROOT = Path(__file__).resolve().parents[1]


def _leaf_fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaf_fields(ann, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def test_config_page_matches_the_code():
    page = ROOT / PAGE
    assert page.is_file(), f"{PAGE} is missing; run {REGENERATE}"
    assert page.read_text(encoding="utf-8") == config_page(), f"{PAGE} differs from the code; run {REGENERATE}"


def test_page_is_title_intro_then_table():
    page = config_page()
    assert page.startswith("# Configuration reference\n") and page.endswith("|\n")
    intro, table = page.split("\n| key | default | meaning |\n", 1)
    assert intro == INTRO and "key.path=value" in intro and "(RLinf key)" in intro and REGENERATE in intro
    assert f"| key | default | meaning |\n{table}" == config_table() + "\n"


def test_readme_links_the_page_and_holds_no_table():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"({PAGE})" in readme, f"README should link {PAGE}"
    assert "| `run.name` |" not in readme, f"the config table lives in {PAGE} only"


def test_every_config_field_has_a_description():
    missing = [key for key, field in _leaf_fields(TidalConfig) if not (field.description or "").strip()]
    assert not missing, f"config fields without a description (add Field(..., description=...)): {missing}"


def test_descriptions_render_as_written_in_markdown():
    """Outside `code spans`, `<name>` would vanish as an HTML tag and `*` / `_` pairs would turn italic."""
    bad = {}
    for key, field in _leaf_fields(TidalConfig):
        prose = re.sub(r"`[^`]*`", "", field.description or "")
        if re.search(r"<[A-Za-z/!]", prose) or "*" in prose or prose.count("`"):
            bad[key] = field.description
    assert not bad, f"put these in backticks: {bad}"


def test_one_row_per_leaf_key_in_declaration_order():
    rows = config_rows()
    assert [r.key for r in rows] == [key for key, _ in _leaf_fields(TidalConfig)]
    assert len({r.key for r in rows}) == len(rows)
    by_key = {r.key: r for r in rows}
    assert by_key["cluster.component_placement"].default == "`{actor: 0-1, rollout: 2-5, inference: 6-7}`"
    assert by_key["warm_start.iters"].default == str(TidalConfig().warm_start.iters)
    assert by_key["model.path"].default == "null"


class _Color(enum.Enum):
    RED = "red"


@pytest.mark.parametrize("value, text", [
    (None, "null"), (True, "true"), (False, "false"), (0, "0"), (64, "64"), (0.1, "0.1"), (1.0, "1.0"),
    (1e-4, "1e-4"), (1e-3, "1e-3"), (2.5e-5, "2.5e-5"), (0.0, "0.0"), (10000.0, "10000.0"),
    ("auto", "`auto`"), ("", '`""`'), ([], "`[]`"), ({}, "`{}`"), ((0.9, 0.999), "`[0.9, 0.999]`"),
    ({"a": "0-1", "b": [1, 2]}, "`{a: 0-1, b: [1, 2]}`"), (_Color.RED, "`red`"),
])
def test_defaults_render_as_yaml_reads_them(value, text):
    assert render_default(value) == text


def test_nested_sections_factories_and_pipes():
    class Inner(BaseModel):
        mode: Literal["x", "y"] = Field("x", description="x | y")
        items: list[int] = Field(default_factory=lambda: [1, 2], description="some  ints\n  here")

    class Outer(BaseModel):
        inner: Inner = Inner()
        top: int | None = Field(None, description="")

    rows = config_rows(Outer)
    assert rows == [Row("inner.mode", "`x`", "x | y"), Row("inner.items", "`[1, 2]`", "some ints here"),
                    Row("top", "null", "")]
    table = config_table(rows).splitlines()
    assert table[:2] == ["| key | default | meaning |", "|---|---|---|"]
    assert table[2] == "| `inner.mode` | `x` | x \\| y |"


def test_cli_prints_checks_and_writes(tmp_path, capsys):
    assert main([]) == 0
    assert capsys.readouterr().out == config_page()
    doc = tmp_path / "config.md"
    assert main(["--check", str(doc)]) == 1
    assert "is missing" in capsys.readouterr().err
    doc.write_text(config_page().replace("| `run.name` |", "| `run.nom` |"), encoding="utf-8")
    assert main(["--check", str(doc)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--write", str(doc)]) == 0
    assert doc.read_text(encoding="utf-8") == config_page()
    assert main(["--check", str(doc)]) == 0
    assert main(["--write", str(doc)]) == 0
    assert "up to date" in capsys.readouterr().out
