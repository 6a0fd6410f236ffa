"""Generation engines for rollout: the protocol, the native torch engine, request records, migration.

Entry points:
- re-exported here: `GenerationEngine` (the protocol: add / step / abort / export_state / import_state /
  commit_export / cancel_export / update_weights / release_memory / resume), `NativeEngine` and `EngineConfig`,
  the records `Request`, `SamplingParams`, `RequestEvent`, `RequestResult`, `RequestState`, `derive_seed`, and
  the errors `GenerationError`, `EngineBusyError`, `UnknownRequestError`;
- `migration` (`migrate`, `send_requests` / `receive_requests`: two-phase moves between engines, in one process
  or over torch.distributed), `weights` (rollout TP shards cut from the actor's weights at any actor TP),
  `sampler`, `kv_cache`, `vllm_backend.VLLMEngine` (the protocol over a vLLM server process, `vllm_server.py`);
- the native engine's parts, each one idea: `engine_setup` (its config and what it derives), `slots` (per-request
  and per-slot state), `admission` (slots, KV blocks, preemption), `prefill`, `decode_step` (the batched launch and
  its read-back), `engine_states` (request states in and out, with KV).
See docs/rollout.md and docs/vllm.md.

Imports: torch, safetensors, `tidal.engine.model` / `layout` / `tp` / `hf_checkpoint` and `tidal.core.errors`; no Ray,
no driver code. `vllm_server.py` runs in `.venv-vllm` and imports only vLLM, torch, safetensors and the standard
library; Tidal never imports it and talks to it with JSON lines over stdin/stdout.

Invariants:
- exact per request: a request's tokens and log-probs are a function of (weights, prompt, sampling params, seed)
  only, not of the requests sharing its batch, its slot, its arrival time, or migrations between native engines
  of equal `numerics` (each request samples from its own generator; prefill is per request; decode shapes are
  fixed);
- migration never loses or duplicates a request: it is active in exactly one engine at every moment, and a
  failure before the commit leaves the source's copy running;
- the rollout log-prob is the temperature-1 fp32 log-softmax of the sampled token, before temperature, top-k and
  top-p;
- nothing crosses a process boundary as pickle: migration states are safetensors blobs, vLLM commands JSON;
- `abort`, `export_state` or `commit_export` of an unknown, finished, aborted or migrated-away id raises
  `UnknownRequestError`, naming each id and why.
"""

from tidal.engine.generation.engine import EngineConfig, NativeEngine
from tidal.engine.generation.protocol import (
                                              EngineBusyError,
                                              EngineStatus,
                                              GenerationEngine,
                                              GenerationError,
                                              UnknownRequestError,
)
from tidal.engine.generation.requests import (
                                              Request,
                                              RequestEvent,
                                              RequestResult,
                                              RequestState,
                                              SamplingParams,
                                              derive_seed,
)

__all__ = ["EngineConfig", "NativeEngine", "EngineBusyError", "EngineStatus", "GenerationEngine", "GenerationError",
           "UnknownRequestError", "Request", "RequestEvent", "RequestResult", "RequestState", "SamplingParams",
           "derive_seed"]
