"""A `.safetensors` file's header, read and checked without trusting the file and without reading tensor data.

The format (https://github.com/huggingface/safetensors):

    bytes 0..8        N, unsigned 64-bit little-endian: the header's length
    bytes 8..8+N      UTF-8 JSON object: {name: {"dtype": "BF16", "shape": [r, c], "data_offsets": [b, e]}, ...,
                      "__metadata__": {str: str}} (optional metadata)
    bytes 8+N..       the data buffer: tensor `name` is bytes [b, e) of it

`read_header` returns a `SafetensorsHeader` only for a file the safetensors library (and so `transformers` and
vLLM) would read as described: N at most `MAX_HEADER_BYTES` and within the file, a JSON object of entries with a
known dtype, a shape of non-negative integers and offsets whose length is shape x dtype size, the tensors laid end
to end with neither gaps nor overlaps, and the last one ending exactly at the end of the file (a truncated
download ends early; a file with bytes past its tensors is refused by the library, so here too). Anything else is
a `CheckpointError` naming the file, so a damaged weight file is refused before any worker starts instead of
crashing (or silently loading garbage) inside one.

At most `MAX_HEADER_BYTES` + 8 bytes of the file are read, whatever the length field claims.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from tidal.engine.checkpoint import CheckpointError

#: largest header accepted (the safetensors library's own limit): a header claiming more is damage, not a model
MAX_HEADER_BYTES = 100_000_000
#: bytes per element of each safetensors dtype
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
_FIX = "restore the file from the checkpoint's source (a complete download or save_pretrained)"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it: `end - start == prod(shape) x DTYPE_BYTES[dtype]`."""

    dtype: str                 # a key of DTYPE_BYTES
    shape: tuple[int, ...]
    start: int                 # offsets into the data buffer (after the header)
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """What a checked file holds: its tensors by name (file order) and its string metadata."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def _bad(path: Path, problem: str) -> CheckpointError:
    return CheckpointError("model.path", str(path), f"{path.name} {problem}", _FIX)


def _read_json_header(path: Path) -> tuple[object, int]:
    """The header's parsed JSON and the data buffer's length; reads at most MAX_HEADER_BYTES + 8 bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise _bad(path, f"is {size} bytes long, shorter than the 8-byte header length of a safetensors file")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise _bad(path, f"claims a header of {n:,} bytes, more than the {MAX_HEADER_BYTES:,} a safetensors "
                       "file may have")
        if 8 + n > size:
            raise _bad(path, f"is truncated: its header claims {n:,} bytes, the file holds {size - 8:,} after the "
                       "length field")
        raw = f.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise _bad(path, f"has a header that is not valid JSON ({type(err).__name__})") from None
    return doc, size - 8 - n


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path: Path, name: str, info: object) -> TensorEntry:
    """One header entry, checked: known dtype, integer shape, offsets spanning exactly its bytes."""
    if not isinstance(info, dict):
        raise _bad(path, f"describes tensor {name!r} with {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise _bad(path, f"gives tensor {name!r} the unknown dtype {str(dtype)[:40]!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _bad(path, f"gives tensor {name!r} the shape {str(shape)[:80]}, not a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, f"gives tensor {name!r} the data_offsets {str(offsets)[:80]}, not [begin, end] with "
                   "0 <= begin <= end")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise _bad(path, f"gives tensor {name!r} {offsets[1] - offsets[0]:,} bytes, its shape {tuple(shape)} of "
                   f"{dtype} takes {nbytes:,} bytes")
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _check_layout(path: Path, tensors: dict[str, TensorEntry], data_bytes: int) -> None:
    """Tensors end to end from byte 0 of the buffer to its last byte (the safetensors library's rule)."""
    at = 0
    for name, e in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start != at:
            what = "overlaps the tensor before it" if e.start < at else f"leaves a gap of {e.start - at:,} bytes"
            raise _bad(path, f"places tensor {name!r} at byte {e.start:,}: it {what}")
        at = e.end
    if at > data_bytes:
        raise _bad(path, f"is truncated: its tensors end at byte {at:,} of the data, the file holds {data_bytes:,}")
    if at < data_bytes:
        raise _bad(path, f"holds {data_bytes - at:,} bytes past its last tensor")


def read_header(path: str | Path) -> SafetensorsHeader:
    """The checked header of the safetensors file at `path` (a regular file; see the module doc)."""
    p = Path(path)
    doc, data_bytes = _read_json_header(p)
    if not isinstance(doc, dict):
        raise _bad(p, f"has a header that is a JSON {type(doc).__name__}, not an object")
    meta = doc.pop("__metadata__", None) or {}
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad(p, "has a __metadata__ that is not an object of strings")
    tensors = {name: _entry(p, name, info) for name, info in doc.items()}
    _check_layout(p, tensors, data_bytes)
    return SafetensorsHeader(tensors, meta)
