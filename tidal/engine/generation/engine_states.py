"""The native engine's side of moving requests between engines: a request's `RequestState` with its KV, and a
request rebuilt from an imported state (`tidal.engine.generation.migration` moves the states).

    export_state(live, cache, numerics)   tokens, log-probs, generator state, policy version and the K/V of the
                                          positions computed so far: read from the request's KV blocks, or the
                                          imported KV it still waits to load; None before either. `in_place`:
                                          the KV stays in its blocks and the state names them (`kv_blocks`)
    live_from_state(st, ...)              the state checked (ids, version, prompt, token and log-prob counts; its
                                          KV's numerics and shapes or block geometry) and turned into a waiting
                                          request; KV tensors are written into blocks when it is admitted, KV
                                          blocks land in blocks the engine takes at import (`parked`) and
                                          become the slot's own at admission, without a copy

KV moves only between engines of equal `numerics` (`EngineSetup.numerics`): the target then continues the request
bit for bit. A state without KV is re-prefilled on admission (`EngineConfig.reprefill`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tidal.engine.generation.kv_cache import PagedKVCache
from tidal.engine.generation.protocol import GenerationError, check_importable, check_prompt
from tidal.engine.generation.requests import RequestState
from tidal.engine.generation.slots import Live
from tidal.engine.model import ModelArgs


def export_state(live: Live, cache: PagedKVCache, numerics: str, in_place: bool = False) -> RequestState:
    """`live`'s state with its KV (module doc); `in_place`: the KV stays in its blocks, the state names them
    (`RequestState.kv_blocks`, for the transfer layer) instead of carrying a copy."""
    blocks = (cache.blocks_of(live.slot, live.kv_len) if live.slot is not None and live.kv_len
              else live.parked if live.parked is not None else None)
    if in_place and blocks is not None:
        return RequestState(live.request, list(live.tokens), list(live.logprobs), live.generator.get_state(),
                            live.version, None, live.kv_len, numerics, live.migrations, tuple(blocks),
                            cache.layout, len(blocks) * cache.block_nbytes, tuple(live.version_starts))
    if live.parked is not None:
        kv, kv_len = cache.read_blocks(live.parked, live.kv_len), live.kv_len
    elif live.slot is not None:
        kv, kv_len = cache.read(live.slot, live.kv_len), live.kv_len
    elif live.pending_kv is not None:
        kv, kv_len = live.pending_kv, live.pending_kv[0][0].shape[1]
    else:
        kv, kv_len = None, 0
    return RequestState(live.request, list(live.tokens), list(live.logprobs), live.generator.get_state(),
                        live.version, kv, kv_len, numerics if kv is not None else "", live.migrations,
                        version_starts=tuple(live.version_starts))


def live_from_state(st: RequestState, batch_ids: list[str], live: Mapping[str, Live], version: int,
                    args: ModelArgs, num_kv_heads: int, numerics: str, layout: str) -> Live:
    """An imported state as a waiting request of an engine holding `live` at policy `version` (module doc);
    GenerationError or TidalError naming the request and what is wrong with it."""
    where = check_importable(st, batch_ids, live, version)
    check_prompt(st.request, args)
    if len(st.token_ids) != len(st.logprobs) or len(st.token_ids) > st.request.params.max_new_tokens:
        raise GenerationError(f"{where}: {len(st.token_ids)} tokens, {len(st.logprobs)} log-probs, "
                              f"max_new_tokens={st.request.params.max_new_tokens}: the state is corrupt")
    gen = torch.Generator()
    gen.set_state(st.generator_state.to("cpu", torch.uint8))
    out = Live(st.request, gen, list(st.token_ids), list(st.logprobs), st.policy_version,
               migrations=st.num_migrations + 1, version_starts=[(int(i), int(v)) for i, v in st.version_starts])
    if st.kv is not None:
        _check_kv(st, st.kv, where, args, num_kv_heads, numerics)
        out.pending_kv = st.kv
    elif st.kv_blocks is not None:
        _check_blocks(st, where, numerics, layout)
        out.kv_len = st.kv_len   # its blocks are taken by the engine's import, filled by the transfer
    return out


def _check_blocks(st: RequestState, where: str, numerics: str, layout: str) -> None:
    """KV left in the source's blocks can land in this engine's: equal numerics and block geometry."""
    if st.numerics != numerics or st.kv_layout != layout:
        raise GenerationError(f"{where}: its KV blocks were computed with numerics [{st.numerics}] in blocks "
                              f"[{st.kv_layout}], this engine has numerics [{numerics}] and blocks [{layout}]; "
                              "continuing would not be bit-exact. Give "
                              "instances equal max_running_requests/kv budget/dtype/TP/block size, or send "
                              "state.without_kv()")
    n_total = len(st.request.prompt_ids) + len(st.token_ids)
    if not st.token_ids or st.kv_len > n_total - 1:
        raise GenerationError(f"{where}: kv_len {st.kv_len} with {len(st.token_ids)} generated tokens "
                              f"(prompt + generated: {n_total}): the state is corrupt")


def _check_kv(st: RequestState, kv: list[tuple[torch.Tensor, torch.Tensor]], where: str, args: ModelArgs,
              num_kv_heads: int, numerics: str) -> None:
    """The state's KV `kv` was computed with these numerics and has this engine's layers and shapes."""
    if st.numerics != numerics:
        raise GenerationError(f"{where}: its KV was computed with numerics [{st.numerics}], this engine "
                              f"has [{numerics}]; continuing would not be bit-exact. Give instances "
                              "equal max_running_requests/kv budget/dtype/TP, or send state.without_kv()")
    n_total = len(st.request.prompt_ids) + len(st.token_ids)
    want = (num_kv_heads, st.kv_len, args.head_dim)
    ok = len(kv) == args.num_layers and st.kv_len <= n_total - 1 and all(
        tuple(k.shape) == want and tuple(v.shape) == want for k, v in kv)
    if not ok or not st.token_ids:
        raise GenerationError(f"{where}: KV of {len(kv)} layers, kv_len {st.kv_len}, shapes "
                              f"{[tuple(k.shape) for k, _ in kv[:1]]}; expected {args.num_layers} "
                              f"layers of {want} with kv_len < prompt + generated ({n_total})")
