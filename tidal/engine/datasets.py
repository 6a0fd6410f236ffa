"""Prompt datasets for RL: read GSM8K/MATH-style files, filter by prompt length, a resumable seeded order.

Files (`read_records`; one `DataSpec` lists them, rows keep file order then row order):

    suffix     read with                                      one row
    .jsonl     one JSON object a line, blank lines skipped,   {"question": "Natalia sold 48 clips ...",
               a UTF-8 byte-order mark at the start allowed    "answer": "... #### 72"}
    .parquet   pyarrow.parquet.read_table(path).to_pylist()   {"data_source": "openai/gsm8k",
                                                               "prompt": [{"role": "user", "content": "..."}],
                                                               "reward_model": {"style": "rule",
                                                                                "ground_truth": "72"},
                                                               "extra_info": {"index": 0}}

The layouts verl users have, and the keys that read them:

    GSM8K jsonl (HF dump)     prompt_key="question"  answer_key="answer"    answer kept whole ("... #### 72"):
                                                                           extracting "72" is the reward's job
    verl parquet (gsm8k.py,   prompt_key="prompt"    answer_key="reward_model.ground_truth"
      math_dataset.py)
    plain jsonl               prompt_key="prompt"    answer_key="answer"    numbers allowed: 72 and 72.0 -> "72"

A key is a dotted path: "reward_model.ground_truth" reads row["reward_model"]["ground_truth"]. A top-level
key that itself contains a dot wins over the path (an exact column name is never shadowed).
A prompt is text or chat messages: a non-empty list of mappings with string "role" and "content" (other
keys, e.g. the null fields a parquet struct column adds, are ignored), kept as ((role, content), ...).
`data_source` and `extra_info` are read when the row has them (else the file stem and {}).
Row numbers are 0-based and are the ones in the uid ("gsm8k:3" is row 3 of gsm8k.jsonl); jsonl errors
also give the 1-based line number, as an editor shows it. Every bad input is a `DataError` that names the
config field, the file, the row and the fix.

Length (`filter_by_length`): each prompt is rendered once by the caller's function (tokenizer + chat
template); prompts over `max_prompt_length` tokens are dropped and counted ("filter") or fail the run
("error"); the token ids come back with the kept records so nothing renders twice.

Size bounds, so one huge row costs neither memory nor time: taking no token to spell more than
`MAX_TOKEN_CHARS` characters (a generous bound), a prompt longer than `max_prompt_length * MAX_TOKEN_CHARS`
characters is over the limit without rendering it, and a jsonl line longer than `max_row_bytes(max_prompt_length)`
bytes (that bound, times JSON's worst escape of 12 bytes a character, plus `ROW_SLACK_BYTES` for the row's other
columns) holds such a prompt too. `read_bounded` reads jsonl line by line in binary, never more than the bound plus
one byte of a line at once; a longer line is skipped unparsed and comes back as an `OversizedRow`, which
`filter_by_length` counts and refuses like any over-long prompt (`data.truncation`). Parquet is read whole (a
column store); its over-long prompts are caught before rendering.

JSON that Python's reader cannot hold (an integer of more than 4300 digits, nesting deeper than the
interpreter's recursion limit) is a `DataError` naming the file and row: such a row is a broken file, not a
long prompt, so it is refused whatever `data.truncation` says.

Order (`PromptStream`): epoch e visits every item once, in `order(e)`, a permutation that is a pure
function of (seed, e): a Fisher-Yates shuffle driven by a splitmix64 stream seeded from (seed, e). Not
`random.Random`: its seeding from a str/int is stable (sha512 of the str since 3.2), but the docs
guarantee only `random()`'s sequence across versions ("Notes on Reproducibility"); `shuffle`, `randrange`
and `_randbelow` may change. Our 30 lines cannot change under us, on any machine or Python.
Because any epoch's order can be recomputed, the data position is two integers, `DataPosition(epoch,
offset)`: `offset` prompts of epoch `epoch` are already taken. `take(n, pos)` continues from `pos`,
crossing into later epochs as needed, and returns the position after the taken prompts, normalised so
that `0 <= offset < num_items` (a finished epoch reads `(epoch + 1, 0)`). Taking k1 then k2 from the
returned position gives exactly the indices of taking k1 + k2 at once, so a checkpoint stores the
position and a resumed run continues mid-epoch. The position does not fingerprint the data: resuming
with a different file list of the same length continues silently; a shorter one (offset past the end)
is an error.

Worked example, 5 items, seed 0 (pinned by the tests):

    order(0) = [2, 3, 1, 4, 0]          order(1) = [2, 4, 1, 3, 0]
    take(3, DataPosition(0, 0)) -> [2, 3, 1], DataPosition(0, 3)
    take(4, DataPosition(0, 3)) -> [4, 0, 2, 4], DataPosition(1, 2)      (2 from epoch 0, 2 from epoch 1)
    take(3, DataPosition(1, 2)) -> [1, 3, 0], DataPosition(2, 0)         (epoch 1 done: rolls to epoch 2)

Item 4 comes twice in the second call, once per epoch: an epoch boundary inside a batch is allowed.
A shuffle costs about 1 s per million items in pure Python; the stream keeps the current epoch's order.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

from tidal.core.errors import TidalError

Prompt = str | tuple[tuple[str, str], ...]  # plain text, or chat messages as ((role, content), ...)

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")
PROMPT_KEY_FIELD = "data.prompt_key"
ANSWER_KEY_FIELD = "data.answer_key"
POSITION_FIELD = "checkpoint data position"
_LISTED_KEYS = 30  # key paths listed in a "key missing" message; rows wider than this are cut with "..."

#: Characters one token spells, at most, generously: BPE vocabularies' longest tokens are runs of spaces or
#: punctuation a few dozen characters long.
MAX_TOKEN_CHARS = 256
#: Bytes one character takes in a JSON line, at most: a character outside the BMP escaped as two \uXXXX.
JSON_BYTES_PER_CHAR = 12
#: Bytes a row may spend outside its prompt (answer, data_source, extra_info, keys, chat-message wrapping).
ROW_SLACK_BYTES = 1 << 20
_BOM = b"\xef\xbb\xbf"
_SKIP_CHUNK = 1 << 20  # bytes read at a time while skipping an oversized line


def max_prompt_chars(max_prompt_length: int) -> int:
    """Characters a prompt of `max_prompt_length` tokens can have, at most (its text, before the chat template)."""
    return max_prompt_length * MAX_TOKEN_CHARS


def max_row_bytes(max_prompt_length: int) -> int:
    """Bytes a jsonl line can have when its prompt fits `max_prompt_length` tokens: longer lines are not parsed."""
    return max_prompt_chars(max_prompt_length) * JSON_BYTES_PER_CHAR + ROW_SLACK_BYTES


class DataError(TidalError):
    """A data file, a data key or a data position that cannot feed a run."""


# ---- records ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptRecord:
    uid: str  # f"{file_stem}:{row}", or f"f{file_index}:{row}" when two files share a stem
    prompt: Prompt
    answer: str  # ground truth as text
    data_source: str  # the row's "data_source", else the file stem
    extra_info: dict = field(default_factory=dict)  # JSON values only (checked when read)


@dataclass(frozen=True)
class OversizedRow:
    """A jsonl row over `max_row_bytes`: skipped unparsed; its prompt is over the limit whatever it holds."""

    uid: str
    where: str  # "file row 3 (line 5)"
    num_bytes: int
    max_bytes: int  # the bound it broke


@dataclass(frozen=True)
class PromptLabel:
    """What the verifier needs of a prompt: it travels with its group (also across migrations) to the scorer."""

    uid: str
    """Stable sample id (`file:row`, or `task:index` for a built-in task): named when a reward function fails."""
    answer: str
    """Ground truth text."""
    data_source: str = ""
    """verl's `data_source` (the file stem otherwise): the first argument of a custom reward function."""
    extra_info: str = "{}"
    """verl's `extra_info`, as JSON text."""


@dataclass(frozen=True)
class DataSpec:
    files: tuple[str, ...]
    prompt_key: str = "prompt"  # dotted path allowed
    answer_key: str = "answer"  # dotted path, e.g. "reward_model.ground_truth"
    field: str = "data.train_files"  # the config field named in errors

    def __post_init__(self) -> None:
        # A lone string would otherwise be read as a tuple of one-character paths.
        if isinstance(self.files, str):
            raise DataError(self.field, self.files, "is one path string, not a list of paths",
                            f"write {self.field}: [{self.files!r}]")
        object.__setattr__(self, "files", tuple(self.files))
        if not self.files or not all(isinstance(f, str) and f for f in self.files):
            raise DataError(self.field, self.files, "must be a non-empty list of file paths",
                            f"list at least one {' or '.join(SUPPORTED_SUFFIXES)} file")
        for name, key in ((PROMPT_KEY_FIELD, self.prompt_key), (ANSWER_KEY_FIELD, self.answer_key)):
            if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
                raise DataError(name, key, "must be a column name or a dotted path like a.b",
                                f"set {name} to the row's key, e.g. 'prompt' or 'reward_model.ground_truth'")


@dataclass(frozen=True)
class _Where:
    """Where a row came from, for error messages: `file row 3 (line 5)`."""

    file: str
    row: int
    line: int | None = None  # jsonl only

    def __str__(self) -> str:
        return f"{self.file} row {self.row}" + (f" (line {self.line})" if self.line is not None else "")


def read_records(spec: DataSpec) -> list[PromptRecord]:
    """All rows of `spec.files`, in file order then row order, as validated `PromptRecord`s (no size bound)."""
    records, oversized = read_bounded(spec, None)
    assert not oversized, oversized  # no bound, no oversized rows
    return records


def read_bounded(spec: DataSpec, max_bytes: int | None) -> tuple[list[PromptRecord], list[OversizedRow]]:
    """The rows of `spec.files` as `read_records` gives them, except jsonl rows over `max_bytes` (None: no bound),
    which come back unparsed as `OversizedRow`s. Memory: at most `max_bytes` + 1 bytes of a line are held at once."""
    paths = [Path(f) for f in spec.files]
    stems = [p.stem for p in paths]
    records: list[PromptRecord] = []
    oversized: list[OversizedRow] = []
    for path, stem, tag in zip(paths, stems, _file_tags(spec)):
        rows = _read_rows(path, spec.field, max_bytes)
        for row, (where, value) in enumerate(rows):
            assert where.row == row
            if isinstance(value, _Oversized):
                assert max_bytes is not None
                oversized.append(OversizedRow(f"{tag}:{row}", str(where), value.num_bytes, max_bytes))
            else:
                records.append(_checked_record(value, where, stem, tag, spec))
    return records, oversized


def _file_tags(spec: DataSpec) -> list[str]:
    """The uid prefix of each file: its stem, or f"f{index}" for every file when two share a stem, so a uid never
    depends on which other files happen to share names."""
    stems = [Path(f).stem for f in spec.files]
    return stems if len(set(stems)) == len(stems) else [f"f{i}" for i in range(len(stems))]


def file_of(spec: DataSpec, uid: str) -> str:
    """The file of `spec` the record `uid` was read from."""
    return spec.files[_file_tags(spec).index(uid.rpartition(":")[0])]


def row_of(spec: DataSpec, uid: str) -> str:
    """Where the record `uid` of `spec` was read: "path row 3", for messages about a record after reading."""
    return f"{file_of(spec, uid)} row {uid.rpartition(':')[2]}"


@dataclass(frozen=True)
class _Oversized:
    """A jsonl line over the size bound, in place of its value: never decoded or parsed."""

    num_bytes: int


def _read_rows(path: Path, field_name: str, max_bytes: int | None) -> list[tuple[_Where, object]]:
    if not path.exists():
        raise DataError(field_name, str(path), "file not found",
                        "check the path (relative paths are read from the working directory)")
    if not path.is_file():
        raise DataError(field_name, str(path), "is not a file",
                        f"list {' or '.join(SUPPORTED_SUFFIXES)} files, not folders")
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataError(field_name, str(path), f"unsupported file type {path.suffix or '(no suffix)'!r}",
                        f"convert it to one of the supported types: {', '.join(SUPPORTED_SUFFIXES)}")
    rows = _read_jsonl(path, field_name, max_bytes) if suffix == ".jsonl" else _read_parquet(path, field_name)
    if not rows:
        raise DataError(field_name, str(path), "has no rows", "remove the file from the list or fill it")
    return rows


def _read_jsonl(path: Path, field_name: str, max_bytes: int | None = None) -> list[tuple[_Where, object]]:
    """One value per non-blank line; a line over `max_bytes` is an `_Oversized`, read past in chunks, never parsed."""
    rows: list[tuple[_Where, object]] = []
    read_at_most = -1 if max_bytes is None else max_bytes + 1  # one byte more tells an oversized line
    line_no = 0
    with path.open("rb") as f:
        while raw := f.readline(read_at_most):
            line_no += 1
            if line_no == 1 and raw.startswith(_BOM):  # utf-8-sig: the mark some editors write first
                raw = raw[len(_BOM):]
            if max_bytes is not None and len(raw) > max_bytes and not raw.endswith(b"\n"):
                num_bytes, blank = _skip_line(f, len(raw), raw.isspace())
                if not blank:
                    rows.append((_Where(str(path), len(rows), line_no), _Oversized(num_bytes)))
                continue
            text = _decode(raw, path, field_name, line_no)
            if text.strip():
                where = _Where(str(path), len(rows), line_no)
                rows.append((where, _parse_json(text, where, field_name)))
    return rows


def _skip_line(f: BinaryIO, num_bytes: int, blank: bool) -> tuple[int, bool]:
    """Reads past the rest of an oversized line: its length in bytes (newline excluded), and whether it was all
    whitespace (a blank line, which is no row)."""
    while True:
        chunk = f.readline(_SKIP_CHUNK)
        ended = not chunk or chunk.endswith(b"\n")
        body = chunk[:-1] if chunk.endswith(b"\n") else chunk
        num_bytes += len(body)
        blank = blank and (not body or body.isspace())
        if ended:
            return num_bytes, blank


def _decode(raw: bytes, path: Path, field_name: str, line_no: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(field_name, str(path), f"is not UTF-8 text ({e.reason} at byte {e.start} of line {line_no})",
                        "save the file as UTF-8") from None


def _parse_json(text: str, where: _Where, field_name: str) -> object:
    """The line's JSON value; every way Python's reader refuses a line is a DataError naming the row."""
    line_no = where.line
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(field_name, where.file, f"invalid JSON on line {line_no}: {e.msg} at column {e.colno}",
                        f"fix line {line_no}: each line must be one JSON object") from None
    except RecursionError:
        raise DataError(field_name, where.file, f"{where} nests lists or objects deeper than Python's JSON reader "
                        f"follows (about {sys.getrecursionlimit()} levels)",
                        "flatten the row, or remove it") from None
    except ValueError as e:  # an integer literal over sys.get_int_max_str_digits() digits
        raise DataError(field_name, where.file, f"{where} holds a number Python's JSON reader refuses "
                        f"({str(e).split(':')[0]})", 'write such a number as a string ("answer": "123...")') from None


def _read_parquet(path: Path, field_name: str) -> list[tuple[_Where, object]]:
    try:
        import pyarrow.parquet as pq  # lazy: jsonl-only users need no pyarrow
    except ImportError:
        raise DataError(field_name, str(path), "needs pyarrow to read parquet, which is not installed",
                        "pip install 'pyarrow>=15' or convert the file to .jsonl") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError...: all mean "not a parquet file we can read"
        raise DataError(field_name, str(path), f"is not a readable parquet file ({type(e).__name__}: {e})",
                        "check that the file is complete and really parquet") from None
    return [(_Where(str(path), i), row) for i, row in enumerate(table.to_pylist())]


def _checked_record(value: object, where: _Where, stem: str, tag: str, spec: DataSpec) -> PromptRecord:
    """`_to_record`, with nesting too deep to walk (a parquet struct, or JSON just under the reader's limit whose
    copy or key listing goes deeper) a DataError naming the row."""
    try:
        return _to_record(value, where, stem, tag, spec)
    except RecursionError:
        raise DataError(spec.field, where.file, f"{where} nests lists or objects too deep to read",
                        "flatten the row, or remove it") from None


def _to_record(value: object, where: _Where, stem: str, tag: str, spec: DataSpec) -> PromptRecord:
    if not isinstance(value, Mapping):
        raise DataError(spec.field, where.file, f"{where} is a JSON {_json_type(value)}, not an object",
                        'make every row an object like {"prompt": ..., "answer": ...}')
    row: Mapping[str, Any] = value
    prompt = _prompt(_lookup(row, spec.prompt_key, PROMPT_KEY_FIELD, where), spec.prompt_key, where)
    answer = _answer(_lookup(row, spec.answer_key, ANSWER_KEY_FIELD, where), spec.answer_key, where)
    return PromptRecord(uid=f"{tag}:{where.row}", prompt=prompt, answer=answer,
                        data_source=_data_source(row.get("data_source"), stem, spec.field, where),
                        extra_info=_extra_info(row.get("extra_info"), spec.field, where))


def _lookup(row: Mapping[str, Any], key: str, field_name: str, where: _Where) -> object:
    if key in row:  # an exact column name wins over the dotted path
        return row[key]
    node: object = row
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise DataError(field_name, key, f"{where} has no key {key!r} (its keys: {_key_paths(row)})",
                            f"set {field_name} to one of them")
        node = node[part]
    return node


def _key_paths(row: Mapping[str, Any]) -> str:
    """The row's keys, nested mappings spelled as dotted paths: what `prompt_key`/`answer_key` accept."""
    paths: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, Mapping) and v:
                walk(v, f"{prefix}{k}.")
            else:
                paths.append(f"{prefix}{k}")

    walk(row, "")
    shown = ", ".join(paths[:_LISTED_KEYS])
    return f"[{shown}{', ...' if len(paths) > _LISTED_KEYS else ''}]"


def _prompt(value: object, key: str, where: _Where) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(PROMPT_KEY_FIELD, key, f"{where} has an empty prompt", "remove the row or fill its prompt")
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for m in value:
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                break
            messages.append((m["role"], m["content"]))
        else:
            return tuple(messages)
    raise DataError(PROMPT_KEY_FIELD, key,
                    f"{where}: the prompt is a {_json_type(value)} {_short(value)}, neither text nor a non-empty "
                    f'list of {{"role": str, "content": str}} messages',
                    f"set {PROMPT_KEY_FIELD} to the key that holds the prompt text or chat messages")


def _answer(value: object, key: str, where: _Where) -> str:
    if isinstance(value, str):
        return value
    # bool is an int subclass, but True is no ground truth: refuse it with the other non-numbers.
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else str(value)  # 72.0 -> "72", as it was written
    raise DataError(ANSWER_KEY_FIELD, key,
                    f"{where}: the answer is a {_json_type(value)} {_short(value)}, not text or a finite number",
                    f"set {ANSWER_KEY_FIELD} to the key that holds the ground truth, or fix the row")


def _data_source(value: object, stem: str, field_name: str, where: _Where) -> str:
    if value is None:  # absent, or a null cell of a parquet column
        return stem
    if not isinstance(value, str):
        raise DataError(field_name, where.file, f"{where}: data_source is a {_json_type(value)}, not text",
                        "make data_source a string or drop the column")
    return value


def _extra_info(value: object, field_name: str, where: _Where) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise DataError(field_name, where.file, f"{where}: extra_info is a {_json_type(value)}, not an object",
                        "make extra_info an object (mapping) or drop the column")
    try:
        # A JSON round trip both checks the values and gives a private copy in plain JSON types, so a
        # record can be logged or checkpointed as is.
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise DataError(field_name, where.file, f"{where}: extra_info is not JSON-serialisable ({e})",
                        "keep extra_info to strings, numbers, booleans, null, lists and objects") from None


def _json_type(value: object) -> str:
    names = {str: "string", bool: "boolean", int: "number", float: "number", list: "list", tuple: "list",
             dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- length filter ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class FilterReport:
    kept: int
    too_long: int  # prompts over max_prompt_length tokens (dropped, or an error by truncation)
    longest_kept: int  # tokens


def filter_by_length(records: list[PromptRecord], prompt_token_ids: Callable[[Prompt], list[int]],
                     max_prompt_length: int, truncation: Literal["filter", "error"] = "filter",
                     field: str = "data.max_prompt_length", oversized: Sequence[OversizedRow] = (),
                     ) -> tuple[list[tuple[PromptRecord, tuple[int, ...]]], FilterReport]:
    """Render every prompt once; keep those of at most `max_prompt_length` tokens, with their token ids.

    Over the limit without rendering, and counted in `too_long` like a rendered one: each of `oversized` (rows
    `read_bounded` skipped), and a prompt of more than `max_prompt_chars(max_prompt_length)` characters."""
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or max_prompt_length < 1:
        raise DataError(field, max_prompt_length, "must be a positive number of tokens", f"set {field}: 1024")
    if truncation not in ("filter", "error"):
        raise DataError("data.truncation", truncation, "must be 'filter' or 'error'",
                        "set data.truncation: filter (drop long prompts) or error (fail on the first)")
    fix_long = f"raise {field}, or set data.truncation: filter to drop such prompts"
    if oversized and truncation == "error":
        row = oversized[0]
        raise DataError(field, max_prompt_length, f"{row.where} is {row.num_bytes:,} bytes, over the {row.max_bytes:,} "
                        f"a row whose prompt fits {max_prompt_length} tokens can take (not read)", fix_long)
    max_chars = max_prompt_chars(max_prompt_length)
    kept: list[tuple[PromptRecord, tuple[int, ...]]] = []
    too_long, shortest_dropped = len(oversized), None
    for record in records:
        chars = _prompt_chars(record.prompt)
        if chars > max_chars:  # more characters than max_prompt_length tokens can spell: not worth rendering
            if truncation == "error":
                raise DataError(field, max_prompt_length, f"prompt {record.uid} is {chars:,} characters, more than "
                                f"{max_prompt_length} tokens spell", fix_long)
            too_long += 1
            continue
        ids = tuple(prompt_token_ids(record.prompt))
        if len(ids) <= max_prompt_length:
            kept.append((record, ids))
            continue
        if truncation == "error":
            raise DataError(field, max_prompt_length,
                            f"prompt {record.uid} is {len(ids)} tokens, over the limit of {max_prompt_length}",
                            f"raise {field} to at least {len(ids)} or set data.truncation: filter to drop such prompts")
        too_long += 1
        shortest_dropped = len(ids) if shortest_dropped is None else min(shortest_dropped, len(ids))
    if not kept:
        shortest = f" (shortest: {shortest_dropped})" if shortest_dropped is not None else ""
        problem = (f"all {too_long} prompts are over {max_prompt_length} tokens{shortest}: nothing to train on"
                   if too_long else "there are no prompts: nothing to train on")
        fix = (f"raise {field} to at least {shortest_dropped}" if shortest_dropped is not None
               else f"raise {field}" if too_long else "list files with rows")
        raise DataError(field, max_prompt_length, problem, fix)
    return kept, FilterReport(kept=len(kept), too_long=too_long, longest_kept=max(len(ids) for _, ids in kept))


def _prompt_chars(prompt: Prompt) -> int:
    """Characters of a prompt's text (a chat's contents summed): a lower bound of what the template renders."""
    return len(prompt) if isinstance(prompt, str) else sum(len(content) for _, content in prompt)


# ---- order and position ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    offset: int = 0  # prompts already taken in this epoch

    def __post_init__(self) -> None:
        for name in ("epoch", "offset"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise DataError(POSITION_FIELD, v, f"{name} must be a non-negative integer",
                                "resume from a checkpoint written by Tidal, or start without a data position")

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    @staticmethod
    def from_json(d: object) -> DataPosition:
        # Strict: exactly the two keys, so a checkpoint of another layout is refused, not half-read.
        if not isinstance(d, Mapping) or set(d) != {"epoch", "offset"}:
            raise DataError(POSITION_FIELD, d, 'must be an object with exactly the keys "epoch" and "offset"',
                            "resume from a checkpoint written by Tidal, or start without a data position")
        return DataPosition(epoch=d["epoch"], offset=d["offset"])


_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio)


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with full avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class _SplitMix64:
    """The splitmix64 generator (Steele, Lea, Flood 2014): state += gamma, output mix(state)."""

    def __init__(self, state: int):
        self.state = state & _M64

    def next(self) -> int:
        self.state = (self.state + _GAMMA) & _M64
        return _mix64(self.state)

    def below(self, bound: int) -> int:
        """Uniform in [0, bound): reject the top partial block of 2^64 so no index is favoured."""
        limit = (1 << 64) - (1 << 64) % bound
        while (x := self.next()) >= limit:
            pass
        return x % bound


def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    # Seed and epoch are mixed separately, so (seed, epoch) and (seed', epoch') only collide when the
    # 64-bit mixes collide; a negative seed is taken modulo 2^64.
    rng = _SplitMix64(_mix64(_mix64(seed & _M64) ^ epoch))
    order = list(range(n))
    for i in range(n - 1, 0, -1):  # Fisher-Yates: every permutation equally likely
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


class PromptStream:
    """Seeded, epoch-based order over a fixed list of items: random access, so the data position is two integers."""

    def __init__(self, num_items: int, seed: int, shuffle: bool = True):
        if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
            raise ValueError(f"num_items must be a positive int, got {num_items!r}")  # callers filter first
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.num_items, self.seed, self.shuffle = num_items, seed, shuffle
        self._cached: tuple[int, list[int]] | None = None  # (epoch, order): take() walks one epoch at a time

    def order(self, epoch: int) -> list[int]:
        """A permutation of range(num_items), a pure function of (seed, epoch); identity when shuffle=False."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        return list(self._epoch_order(epoch))  # a copy: callers may mutate theirs

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            perm = _permutation(self.num_items, self.seed, epoch) if self.shuffle else list(range(self.num_items))
            self._cached = (epoch, perm)
        return self._cached[1]

    def take(self, n: int, position: DataPosition) -> tuple[list[int], DataPosition]:
        """The next n item indices from `position`, and the position after them (0 <= offset < num_items)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if position.offset > self.num_items:
            raise DataError(POSITION_FIELD, position.to_json(),
                            f"offset {position.offset} is past the end of an epoch of {self.num_items} prompts: "
                            "the data changed since the checkpoint was written",
                            "resume with the same data files and filters, or start without a data position")
        epoch, offset = position.epoch, position.offset
        taken: list[int] = []
        while True:
            if offset == self.num_items:  # invariant of the returned position: offset < num_items
                epoch, offset = epoch + 1, 0
            if len(taken) == n:
                return taken, DataPosition(epoch, offset)
            step = min(n - len(taken), self.num_items - offset)
            taken += self._epoch_order(epoch)[offset:offset + step]
            offset += step
