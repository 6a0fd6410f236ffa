"""The vLLM side of the vLLM generation backend: one process in `.venv-vllm`, driven over stdin/stdout.

Runs as a script (`.venv-vllm/bin/python tidal/engine/generation/vllm_server.py`), never imported by tidal: it may use
only vllm, torch, safetensors and the standard library, because vLLM does not co-install with tidal's
dependencies (Prefect's fastapi pin). The client is `vllm_backend.VLLMEngine`.

Wire protocol: JSON lines. The client writes one object `{"op": ..., ...}` per line to stdin; the server answers
each with exactly one line on its *original* stdout, `{"ok": true, ...}` or `{"ok": false, "error": "...",
"type": "<exception class>"}`. Everything else the process prints (vLLM's logging, warnings, torch) goes to
stderr: fd 1 is pointed at fd 2 at startup and the protocol keeps a private duplicate of the old fd 1. Tensors
never travel on the wire: weights are a safetensors file in a private (0700) directory the client owns, and a
generator state is base64 of `torch.Generator.get_state()` bytes. No pickle anywhere.

    op          fields                                          answer
    load        model_dir, dtype, max_num_seqs, seed, tp,       vllm/torch versions, max_model_len,
                max_model_len?  (default: the config's)         architectures, model_class
    reload      model_dir  (weights only; same config)          seconds
    add         id, prompt_ids, temperature, top_p, top_k,      -
                max_tokens, stop_token_ids, seed, gen_state?
    step        -                                               outputs: [{id, new_token_ids, new_logprobs,
                                                                finish_reason|null}]
    abort       ids                                             -
    export      ids   (reads generator states, then aborts)    states: {id: gen_state|null}
    release     -     (drops the vllm.LLM: weights + KV freed)  -
    shutdown    -                                               - (then exits)

One `step` is one `LLMEngine.step()`: vLLM schedules (admits waiting requests, chunked prefill, decode) and
returns the new tokens of every request that advanced. `output_kind=DELTA` so each answer carries only new
tokens; `logprobs=0` with `logprobs_mode="raw_logprobs"` gives log-softmax of the raw logits at the sampled
token: the same quantity as the native engine's rollout log-prob (temperature 1, before top-k/top-p).

Per-request randomness: `SamplingParams(seed=s)` makes vLLM's model runner build a CPU `torch.Generator`
seeded with s for that request (the native engine seeds its generator the same way). On CPU vLLM draws one
`randint(2**31)` from it per sampled token (the seed of that token's Gumbel noise). `export` reads that
generator's state; `add` with `gen_state` installs a saved state into the new request's generator before its
first sample (a wrapper around the runner's `_update_states`, the only place the generator is created), so a
request aborted and re-added with prompt + generated tokens keeps its random stream. vLLM version pinned in
`scripts/setup_vllm`; the hook checks the attributes it needs and fails loudly if a vLLM release moves them.

Environment set before vllm is imported: in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no
background process, `LLMEngine.step()` runs the model in this process), `VLLM_CPU_KVCACHE_SPACE` defaults to 1
(GiB of KV cache on CPU), no usage stats.
"""

from __future__ import annotations

import os
import sys

# Running this file as a script puts its folder first on sys.path, where tidal's `requests.py` would shadow the
# `requests` package vLLM imports. The client starts us with `python -I` (no script dir); this covers manual runs.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import base64
import gc
import json
import time
import traceback

PROTOCOL_VERSION = 1


def _claim_stdout():
    """Keep the real stdout for the protocol; send everything else written to fd 1 to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


PROTO = _claim_stdout()
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # after the environment above
import vllm
from vllm import LLM, SamplingParams
from vllm.sampling_params import RequestOutputKind


class ProtocolError(Exception):
    """A malformed command from the client (a bug on the tidal side)."""


def _runner(worker):
    """The model runner of vLLM's (in-process) worker; collective_rpc may hand us the worker or its wrapper."""
    worker = getattr(worker, "worker", worker)
    runner = getattr(worker, "model_runner", None)
    if runner is None or not hasattr(runner, "requests") or not hasattr(runner, "_update_states"):
        raise RuntimeError(f"vllm {vllm.__version__}: the worker has no model_runner with requests/_update_states; "
                           "this server supports the vLLM pinned in scripts/setup_vllm")
    return runner


def _model_class(worker) -> str:
    """The class vLLM built the model as (e.g. Qwen2ForCausalLM, not a generic Transformers fallback)."""
    runner = _runner(worker)
    model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
    return type(model).__name__


class Server:
    def __init__(self):
        self.llm: LLM | None = None
        self.load_args: dict | None = None
        self.internal: dict[str, str] = {}  # our request id -> vLLM's internal id
        self.pending_gen: dict[str, bytes] = {}  # internal id -> generator state to install at first schedule

    # ---- model -----------------------------------------------------------------------------------------------
    def op_load(self, model_dir: str, dtype: str = "float32", max_num_seqs: int = 8, seed: int = 0, tp: int = 1,
                max_num_batched_tokens: int | None = None, max_model_len: int | None = None) -> dict:
        if self.llm is not None:
            raise ProtocolError("load: a model is already loaded; release first")
        self.load_args = dict(model_dir=model_dir, dtype=dtype, max_num_seqs=max_num_seqs, seed=seed, tp=tp,
                              max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        t0 = time.perf_counter()
        extra = {k: v for k, v in (("max_num_batched_tokens", max_num_batched_tokens),
                                   ("max_model_len", max_model_len)) if v is not None}
        self.llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed, tensor_parallel_size=tp,
                       max_num_seqs=max_num_seqs, enforce_eager=True, enable_prefix_caching=False,
                       async_scheduling=False, logprobs_mode="raw_logprobs", max_logprobs=1,
                       generation_config="vllm", **extra)
        self.llm.collective_rpc(self._install_hook)
        model_class = self.llm.collective_rpc(_model_class)[0]
        cfg = self.llm.llm_engine.model_config
        return {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
                "max_model_len": cfg.max_model_len, "architectures": list(cfg.architectures or []),
                "model_class": model_class, "dtype": str(cfg.dtype), "seconds": time.perf_counter() - t0}

    def _install_hook(self, worker) -> None:
        """Wrap the runner's `_update_states` so imported requests get their saved generator state."""
        runner = _runner(worker)
        original = runner._update_states
        pending = self.pending_gen

        def update_states(scheduler_output, *args, **kwargs):
            out = original(scheduler_output, *args, **kwargs)
            for new in scheduler_output.scheduled_new_reqs:
                state = pending.pop(new.req_id, None)
                if state is not None:
                    gen = runner.requests[new.req_id].generator
                    if gen is None:
                        raise RuntimeError(f"request {new.req_id}: vLLM built no generator although it has a seed")
                    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
            return out

        runner._update_states = update_states

    def _generator_states(self, worker, internal_ids: list[str]) -> dict[str, str | None]:
        runner = _runner(worker)
        out = {}
        for rid in internal_ids:
            req = runner.requests.get(rid)
            gen = None if req is None else req.generator
            out[rid] = None if gen is None else base64.b64encode(gen.get_state().numpy().tobytes()).decode()
        return out

    def op_reload(self, model_dir: str) -> dict:
        llm = self._need_llm("reload")
        if self.internal:
            raise ProtocolError(f"reload: {len(self.internal)} requests in flight")
        t0 = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
        return {"seconds": time.perf_counter() - t0}

    def op_release(self) -> dict:
        if self.internal:
            raise ProtocolError(f"release: {len(self.internal)} requests in flight")
        self.llm = None
        gc.collect()
        return {}

    def _need_llm(self, op: str) -> LLM:
        if self.llm is None:
            raise ProtocolError(f"{op}: no model loaded")
        return self.llm

    # ---- requests --------------------------------------------------------------------------------------------
    def op_add(self, id: str, prompt_ids: list[int], temperature: float, top_p: float, top_k: int, max_tokens: int,
               stop_token_ids: list[int], seed: int, gen_state: str | None = None) -> dict:
        llm = self._need_llm("add")
        if id in self.internal:
            raise ProtocolError(f"add: request {id!r} is already in flight")
        # ignore_eos: config.json names an eos (Llama's default 2); only the request's own stop ids may stop it
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                stop_token_ids=list(stop_token_ids), seed=seed, logprobs=0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA, detokenize=False, skip_special_tokens=False)
        internal = llm.llm_engine.add_request(id, {"prompt_token_ids": list(prompt_ids)}, params)
        self.internal[id] = internal
        if gen_state is not None and temperature > 0:
            self.pending_gen[internal] = base64.b64decode(gen_state)
        return {}

    def op_step(self) -> dict:
        llm = self._need_llm("step")
        outputs = []
        by_internal = {v: k for k, v in self.internal.items()}
        for out in llm.llm_engine.step():
            rid = by_internal.get(out.request_id) or out.request_id
            comp = out.outputs[0] if out.outputs else None
            toks = list(comp.token_ids) if comp is not None else []
            lps = []
            if comp is not None and comp.logprobs:
                for tok, entry in zip(toks, comp.logprobs):
                    lps.append(float(entry[tok].logprob))
            finish = None
            if out.finished:
                finish = comp.finish_reason if comp is not None else "abort"
                self.internal.pop(rid, None)
                self.pending_gen.pop(out.request_id, None)
            outputs.append({"id": rid, "new_token_ids": toks, "new_logprobs": lps, "finish_reason": finish,
                            "stop_reason": None if comp is None else comp.stop_reason})
        return {"outputs": outputs, "unfinished": llm.llm_engine.get_num_unfinished_requests()}

    def _internal_ids(self, op: str, ids: list[str]) -> list[str]:
        unknown = [i for i in ids if i not in self.internal]
        if unknown:
            raise ProtocolError(f"{op}: unknown ids {unknown[:8]}")
        return [self.internal[i] for i in ids]

    def op_abort(self, ids: list[str]) -> dict:
        llm = self._need_llm("abort")
        internal = self._internal_ids("abort", ids)
        llm.llm_engine.abort_request(internal, internal=True)
        for rid, iid in zip(ids, internal):
            self.internal.pop(rid)
            self.pending_gen.pop(iid, None)
        return {}

    def op_export(self, ids: list[str]) -> dict:
        """Generator states of `ids` (null: not scheduled yet or greedy), then abort them in vLLM."""
        llm = self._need_llm("export")
        internal = self._internal_ids("export", ids)
        states = llm.collective_rpc(self._generator_states, args=(internal,))[0]
        out = {}
        for rid, iid in zip(ids, internal):
            pending = self.pending_gen.get(iid)
            # not scheduled yet: the state it was imported with (if any) is still the one to continue from
            out[rid] = states[iid] if states[iid] is not None else (
                None if pending is None else base64.b64encode(pending).decode())
        self.op_abort(ids)
        return {"states": out}


def main() -> None:
    server = Server()
    PROTO.write(json.dumps({"ok": True, "ready": True, "protocol": PROTOCOL_VERSION, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "shutdown":
                PROTO.write(json.dumps({"ok": True}) + "\n")
                break
            handler = getattr(server, f"op_{op}", None)
            if handler is None:
                raise ProtocolError(f"unknown op {op!r}")
            reply = {"ok": True, **handler(**cmd)}
        except Exception as e:  # every failure goes back to the client as one line; the server keeps serving
            traceback.print_exc(file=sys.stderr)
            reply = {"ok": False, "type": type(e).__name__, "error": str(e)}
        PROTO.write(json.dumps(reply) + "\n")
    server.llm = None
    gc.collect()


if __name__ == "__main__":
    main()
