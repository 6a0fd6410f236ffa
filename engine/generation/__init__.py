"""Generation engines for rollout: the protocol, the native torch engine, request records, migration.

See `protocol.py` (what every backend implements), `engine.py` (the native engine and its exactness
guarantee), `migration.py` (two-phase moves and the no-pickle wire format), `weights.py` (rollout TP shards
from the actor's weights) and docs/rollout.md.
"""

from tidal.engine.generation.engine import EngineConfig, NativeEngine
from tidal.engine.generation.protocol import (EngineBusyError, EngineStatus, GenerationEngine, GenerationError,
                                              UnknownRequestError)
from tidal.engine.generation.requests import (Request, RequestEvent, RequestResult, RequestState, SamplingParams,
                                              derive_seed)

__all__ = ["EngineConfig", "NativeEngine", "EngineBusyError", "EngineStatus", "GenerationEngine", "GenerationError",
           "UnknownRequestError", "Request", "RequestEvent", "RequestResult", "RequestState", "SamplingParams",
           "derive_seed"]
