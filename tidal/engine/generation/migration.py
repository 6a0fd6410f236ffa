"""Moving requests between engines while they run: two-phase, exact, never lost or duplicated.

Two phases, the source coordinates (in one process, or across processes with the wire functions below)::

    source                                   target
    export_state(ids)   (frozen here) ──states──> import_state(states, staged=True)   (frozen there)
                        <──────ack: ok / failed──
    ok:     commit_export(ids) (gone here) ─commit─> activate(ids)   (runs there from now on)
    failed: cancel_export(ids) (runs here again)      (nothing was installed, or abort(ids) drops it)

A request is *active* (advances, can finish) in exactly one engine at every moment: frozen copies never
step, and the target activates only after the source has forgotten its copy. A failure before the commit
leaves the source's copy to continue; the target drops what it staged.

Paths: with KV (native engines of equal `numerics` and block geometry), the KV stays in the source's blocks while
the states travel (`export_state(in_place=True)` names them), the target takes blocks at import and the transfer
layer (`tidal.engine.transfer`) copies block for block into them; the target continues at once. With
`reprefill=True` the states travel without KV and the target rebuilds it from prompt + generated tokens (the
path a vLLM backend uses). Either way the request keeps its generator state, so it samples exactly the tokens it
would have sampled unmigrated (bit-exact for native KV moves and native "replay" re-prefill; see `engine.py`).

Wire format (no pickle): a safetensors blob. Tensors `"{i}.gen"` (generator state, uint8) and, for a state
carrying its KV as tensors, `"{i}.k.{layer}"`, `"{i}.v.{layer}"`; metadata key `"tidal.states"` holds a JSON
list of the plain fields (request, tokens, log-probs as exact float reprs, version, kv_len, numerics, the KV's
source blocks and their geometry). Across processes the blob travels as one uint8 tensor after an int64 header
`[num_bytes]` over torch.distributed point-to-point, then the KV blocks stream by `transfer.send_blocks`; the
ack, the receipt (the blocks landed) and the decision are int64 tensors too.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tidal.core.errors import TidalError
from tidal.engine.generation.protocol import GenerationEngine, GenerationError
from tidal.engine.generation.requests import Request, RequestState
from tidal.engine.transfer import copy_blocks, recv_blocks, recv_ints, send_blocks, send_ints

_META_KEY = "tidal.states"


class MigrationFailed(GenerationError):
    """The target refused or failed: the requests continue on the source (named with the cause)."""


@dataclass(frozen=True)
class MigrationReport:
    request_ids: tuple[str, ...]
    path: str
    """"kv" (KV cache moved) or "reprefill" (target rebuilds the KV)."""
    kv_bytes: int
    seconds: float


def kv_bytes(states: Sequence[RequestState]) -> int:
    """The KV the states move: their tensors, or the blocks they name."""
    return sum(st.kv_nbytes if st.kv_blocks is not None else
               sum(k.numel() * k.element_size() * 2 for k, _ in st.kv or ()) for st in states)


def _export(engine: GenerationEngine, ids: Sequence[str], reprefill: bool) -> list[RequestState]:
    """The states of `ids`, frozen: their KV left in place in the source's blocks where the engine has a paged
    pool (`kv_pool`), as tensors where it has none, dropped for a re-prefill."""
    if reprefill:
        return [st.without_kv() for st in engine.export_state(ids)]
    return engine.export_state(ids, in_place=engine.kv_pool is not None)


def _pool(engine: GenerationEngine) -> torch.Tensor:
    pool = engine.kv_pool
    assert pool is not None, "only an engine with a paged pool names blocks or takes them"
    return pool


def _wanted(states: Sequence[RequestState], engine: GenerationEngine) -> list[int]:
    """Per state, 1 where the target took blocks for its KV (the source streams them), else 0."""
    return [int(st.kv_blocks is not None and engine.kv_destination(st.request_id) is not None) for st in states]


def migrate(source: GenerationEngine, target: GenerationEngine, ids: Sequence[str] | None = None,
            reprefill: bool = False) -> MigrationReport:
    """Move `ids` (default: all of the source's unfrozen requests) from source to target, two-phase."""
    t0 = time.perf_counter()
    ids = list(source.request_ids() if ids is None else ids)
    states = _export(source, ids, reprefill)
    try:
        target.import_state(states, staged=True)
    except (GenerationError, TidalError) as e:  # import is all or nothing: nothing was installed there
        source.cancel_export(ids)
        raise MigrationFailed(f"migration of {len(ids)} requests failed on the target, they continue on the "
                              f"source: {e}") from e
    for st in states:
        into = target.kv_destination(st.request_id) if st.kv_blocks is not None else None
        if st.kv_blocks is not None and into is not None:
            copy_blocks(_pool(source), st.kv_blocks, _pool(target), into)
    source.commit_export(ids)
    target.activate(ids)
    return MigrationReport(tuple(ids), "reprefill" if reprefill else "kv", kv_bytes(states),
                           time.perf_counter() - t0)


# ---- wire format --------------------------------------------------------------------------------------------
def states_to_bytes(states: Sequence[RequestState]) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    meta = []
    for i, st in enumerate(states):
        tensors[f"{i}.gen"] = st.generator_state.to("cpu", torch.uint8).contiguous()
        if st.kv is not None:
            for layer, (k, v) in enumerate(st.kv):
                tensors[f"{i}.k.{layer}"] = k.detach().to("cpu").contiguous()
                tensors[f"{i}.v.{layer}"] = v.detach().to("cpu").contiguous()
        meta.append({"request": st.request.to_meta(), "token_ids": list(st.token_ids),
                     "logprobs": [float(x) for x in st.logprobs], "policy_version": st.policy_version,
                     "num_layers": None if st.kv is None else len(st.kv), "kv_len": st.kv_len,
                     "numerics": st.numerics, "num_migrations": st.num_migrations,
                     "kv_blocks": None if st.kv_blocks is None else list(st.kv_blocks),
                     "kv_layout": st.kv_layout, "kv_nbytes": st.kv_nbytes,
                     "version_starts": [list(run) for run in st.version_starts]})
    return st_save(tensors, metadata={_META_KEY: json.dumps(meta)})


def _metadata(blob: bytes) -> dict:
    (n,) = struct.unpack("<Q", blob[:8])  # safetensors: u64 header length, then a JSON header
    return json.loads(blob[8:8 + n].decode("utf-8")).get("__metadata__", {})


def states_from_bytes(blob: bytes, device: torch.device | str = "cpu") -> list[RequestState]:
    meta = json.loads(_metadata(blob)[_META_KEY])
    tensors = st_load(blob)
    out = []
    for i, m in enumerate(meta):
        kv = None
        if m["num_layers"] is not None:
            kv = [(tensors[f"{i}.k.{layer}"].to(device), tensors[f"{i}.v.{layer}"].to(device))
                  for layer in range(m["num_layers"])]
        blocks = m.get("kv_blocks")
        out.append(RequestState(Request.from_meta(m["request"]), list(m["token_ids"]), list(m["logprobs"]),
                                tensors[f"{i}.gen"], m["policy_version"], kv, int(m["kv_len"]), m["numerics"],
                                int(m["num_migrations"]), None if blocks is None else tuple(int(b) for b in blocks),
                                str(m.get("kv_layout", "")), int(m.get("kv_nbytes", 0)),
                                tuple((int(i), int(v)) for i, v in m.get("version_starts", ()))))
    return out


def send_blob(blob: bytes, dst: int, group=None) -> None:
    dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst, group=group)
    if blob:
        dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst, group=group)


def recv_blob(src: int, group=None) -> bytes:
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src, group=group)
    if int(n.item()) == 0:
        return b""
    payload = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.recv(payload, src, group=group)
    return payload.numpy().tobytes()


def _send_flag(value: int, dst: int, group=None) -> None:
    dist.send(torch.tensor([value], dtype=torch.int64), dst, group=group)


def _recv_flag(src: int, group=None) -> int:
    t = torch.zeros(1, dtype=torch.int64)
    dist.recv(t, src, group=group)
    return int(t.item())


def send_requests(engine: GenerationEngine, ids: Sequence[str], dst: int, reprefill: bool = False,
                  group=None) -> MigrationReport:
    """Source side of a cross-process migration (the target runs `receive_requests(engine, src)`).

    Raises `MigrationFailed` (requests continue here) if the target refused them."""
    t0 = time.perf_counter()
    ids = list(ids)
    states = _export(engine, ids, reprefill)
    send_blob(states_to_bytes(states), dst, group)
    if _recv_flag(dst, group) != 1:
        engine.cancel_export(ids)
        _send_flag(0, dst, group)
        raise MigrationFailed(f"rank {dst} refused {len(ids)} requests; they continue here")
    # the KV streams into the blocks the target took (a state that found none free there re-prefills)
    for st, wanted in zip(states, recv_ints(len(states), dst, group) if states else []):
        if wanted:
            send_blocks(_pool(engine), cast(tuple[int, ...], st.kv_blocks), dst, group)
    if _recv_flag(dst, group) != 1:   # the receipt: every block landed there
        engine.cancel_export(ids)
        _send_flag(0, dst, group)
        raise MigrationFailed(f"rank {dst} did not receive the KV of {len(ids)} requests; they continue here")
    engine.commit_export(ids)
    _send_flag(1, dst, group)  # the commit: the target may now run them
    return MigrationReport(tuple(ids), "reprefill" if reprefill else "kv", kv_bytes(states),
                           time.perf_counter() - t0)


def receive_requests(engine: GenerationEngine, src: int, group=None, device: torch.device | str = "cpu"
                     ) -> list[str]:
    """Target side: stage, acknowledge, then activate on the source's commit. Returns the ids now running here
    (empty if the import failed; the source keeps them)."""
    states = states_from_bytes(recv_blob(src, group), device)
    ids = [st.request_id for st in states]
    try:
        engine.import_state(states, staged=True)
        ok = 1
    except (GenerationError, TidalError):
        ok = 0
    _send_flag(ok, src, group)
    if not ok:
        _recv_flag(src, group)   # the source's cancel
        return []
    wanted = _wanted(states, engine)
    if states:
        send_ints(wanted, src, group)
    for st, w in zip(states, wanted):
        if w:
            recv_blocks(_pool(engine), cast(list[int], engine.kv_destination(st.request_id)), src, group)
    _send_flag(1, src, group)
    commit = _recv_flag(src, group)
    if commit == 1:
        engine.activate(ids)
        return ids
    engine.abort(ids)  # coordinator decided to keep them at the source
    return []
