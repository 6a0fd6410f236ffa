"""The vLLM generation backend: `GenerationEngine` implemented by a vLLM server process.

vLLM does not co-install with Prefect 3.9 (fastapi pin), so it runs in its own environment (`.venv-vllm`, made by
`scripts/setup_vllm`) as a child process (`vllm_server.py`); this class is the client, in the tidal process::

    tidal process                                   .venv-vllm/bin/python vllm_server.py
    VLLMEngine.add/step/abort/...  ──JSON line──>   vllm.LLM(...).llm_engine.add_request/step/abort_request
                                   <──JSON line──   new tokens + raw log-probs, finish reasons
    update_weights(w, v)  writes  <tmp 0700>/model/{config.json, model.safetensors}  ──"reload"──> reload_weights

Every call is synchronous: one command, one answer (the server is single-threaded, so no interleaving). The
private temp dir holds the HF-format model directory and the server's log (`server.log`, vLLM's output; its tail
is quoted in every error about the server). The model directory is the format `tidal/engine/hf_checkpoint.py` reads
and writes: our parameter names prefixed with `model.` (`lm_head.weight` as is) and a `config.json` that is
either the checkpoint's own (`hf_config=`: a `model.path` run serves the user's exact config, vocab padding and
RoPE settings included; only the dtype follows `VLLMConfig.dtype`) or one built from `ModelArgs` through
transformers' config classes (`hf_config()` -> `hf_checkpoint.hf_config_for`): Qwen3ForCausalLM for q/k norms,
Qwen2ForCausalLM for q/k/v biases, LlamaForCausalLM otherwise (default, linear or llama3 RoPE). Either way the
config is read back with `read_hf_config` and must give exactly the engine's `ModelArgs`. No pickle: commands
are JSON, weights are safetensors, generator states are base64 bytes.

What the client keeps (the server knows only vLLM's view): per request its tokens and log-probs so far, the
policy version, whether it is frozen by a migration, and its exported generator state. That is what makes the
vLLM path of the protocol work without movable KV:

    export_state(ids)   server reads each request's generator state, then aborts it in vLLM; the client keeps
                        the request frozen with that state (`RequestState.kv` is None)
    cancel_export(ids)  re-add to vLLM with prompt + generated tokens and the saved generator state
    commit_export(ids)  forget it here
    import_state(...)   (activate) the same re-add on the target; a state that carries native KV is accepted and
                        its KV ignored (vLLM re-prefills)

What is token-identical after a vLLM migration (see docs/vllm.md, measured in tests/test_vllm_backend.py):
the tokens before the migration are kept as they were; after it, the request continues from the same
generator state, but its next logits come from a prefill of prompt + generated tokens instead of a decode step,
so they equal the unmigrated logits up to round-off. Greedy continuations are equal unless two logits are
within that round-off (a near-tie); sampled continuations draw the same random numbers and so are equal under
the same condition. Log-probs after the migration are equal up to that round-off (measured 0.0 on the test
model, fp32 CPU; not guaranteed for other shapes, dtypes or GPU kernels). Native <-> vLLM
migrations keep the generator state but the two samplers use it differently (native: one uniform per token,
inverse CDF; vLLM CPU: one randint per token seeding Gumbel noise), so only greedy requests continue with the
same tokens across backends.

Weights: `update_weights` takes the *global* weights (tp=1 names and shapes of `param_specs`); vLLM splits
them itself for `tensor_parallel_size` > 1. Versions and the idle rule are those of `protocol.py`.

Example::

    engine = VLLMEngine(args, weights, VLLMConfig(max_running_requests=8))
    # a model.path run: serve the checkpoint's own config.json (hf = read_hf_config(path, max_seq_len))
    engine = VLLMEngine(hf.args, load_hf_weights(hf), VLLMConfig(), hf_config=hf)
    engine.add(Request("a", (1, 5, 7), SamplingParams(temperature=0.0, max_new_tokens=8)))
    while engine.has_work():
        for ev in engine.step():
            if ev.finished: print(ev.result.token_ids)
    engine.close()
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal, cast

import torch
from safetensors.torch import save_file

from tidal.core.errors import TidalError
from tidal.engine.generation.protocol import (
    EngineStatus,
    GenerationEngine,
    GenerationError,
    check_importable,
    check_prompt,
)
from tidal.engine.generation.requests import Request, RequestEvent, RequestResult, RequestState
from tidal.engine.hf_checkpoint import HFModel, hf_config_for, read_hf_config
from tidal.engine.model import ModelArgs, param_specs

SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")
DEFAULT_VENV = Path(__file__).resolve().parents[3] / ".venv-vllm"
VLLM_MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses temperatures above 2


class VLLMServerError(GenerationError):
    """The vLLM server failed or died; the message quotes its log."""


@dataclass(frozen=True)
class VLLMConfig:
    max_running_requests: int = 64
    """vLLM's `max_num_seqs`: the most requests decoding at once (RLinf key `rollout.max_running_requests`)."""
    dtype: str = "float32"
    """Weights and compute dtype in vLLM ("float32", "bfloat16", "float16")."""
    python: str | None = None
    """Interpreter of the vLLM environment; None: $TIDAL_VLLM_PYTHON, else `<repo>/.venv-vllm/bin/python`."""
    kv_cache_gib: float = 1.0
    """CPU KV cache size in whole GiB (`VLLM_CPU_KVCACHE_SPACE`, an integer); vLLM reserves it up front."""
    tensor_parallel_size: int = 1
    """vLLM's own TP inside the server (it splits the global weights itself)."""
    num_threads: int | None = None
    """Torch/OpenMP threads of the server (CPU); None: vLLM's default (all cores, bound)."""
    seed: int = 0
    """vLLM engine seed (only used by requests without a seed; ours always carry one)."""
    startup_timeout_s: float = 900.0
    """How long building the vllm.LLM may take (CPU startup is tens of seconds) before we give up."""
    op_timeout_s: float = 600.0
    """How long any other command may take."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the server (e.g. VLLM_* settings)."""

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise TidalError("rollout.max_running_requests", self.max_running_requests, "must be >= 1", "e.g. 64")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise TidalError("vllm.dtype", self.dtype, "unknown dtype", 'use "float32", "bfloat16" or "float16"')
        if not self.kv_cache_gib > 0:
            raise TidalError("vllm.kv_cache_gib", self.kv_cache_gib, "must be positive", "e.g. 1")
        if self.kv_cache_gib != int(self.kv_cache_gib):  # vLLM parses VLLM_CPU_KVCACHE_SPACE with int()
            raise TidalError("vllm.kv_cache_gib", self.kv_cache_gib, "must be a whole number of GiB (vLLM's "
                             "VLLM_CPU_KVCACHE_SPACE is an integer)", "e.g. 1")
        if self.tensor_parallel_size < 1:
            raise TidalError("vllm.tensor_parallel_size", self.tensor_parallel_size, "must be >= 1", "e.g. 1")

    def interpreter(self) -> Path:
        path = Path(self.python or os.environ.get("TIDAL_VLLM_PYTHON") or DEFAULT_VENV / "bin" / "python")
        if not path.exists():
            raise TidalError("vllm.python", str(path), "the vLLM environment's interpreter does not exist",
                             "run scripts/setup_vllm (creates .venv-vllm), or set TIDAL_VLLM_PYTHON")
        return path


#: token ids written into a generated config.json unless the caller names others (the repo tokenizer's)
DEFAULT_BOS_ID, DEFAULT_EOS_IDS, DEFAULT_PAD_ID = 1, (2,), 0


def architecture_for(args: ModelArgs) -> str:
    """The Hugging Face family that expresses `args`: Qwen3 (q/k norms), Qwen2 (q/k/v bias), else Llama."""
    if args.qkv_bias and args.qk_norm:
        raise TidalError("model", "qkv_bias=True, qk_norm=True", "no supported Hugging Face family has both q/k/v "
                         "biases and q/k norms", "use qkv_bias (Qwen2) or qk_norm (Qwen3), not both")
    return "Qwen3ForCausalLM" if args.qk_norm else "Qwen2ForCausalLM" if args.qkv_bias else "LlamaForCausalLM"


def hf_config(args: ModelArgs, dtype: str, architecture: str | None = None, *, bos_id: int | None = DEFAULT_BOS_ID,
              eos_ids: Sequence[int] = DEFAULT_EOS_IDS, pad_id: int | None = DEFAULT_PAD_ID) -> dict:
    """A Hugging Face `config.json` equal to our model, built by transformers' config class
    (`hf_checkpoint.hf_config_for`): `architecture` (default `architecture_for(args)`), `dtype` of the weights
    file, and token ids (default those of the repo tokenizer: bos 1, eos 2, pad 0)."""
    arch = architecture or architecture_for(args)
    try:
        cfg = hf_config_for(args, arch, bos_id=bos_id, eos_ids=tuple(eos_ids), pad_id=pad_id)
    except ValueError as e:
        raise TidalError("vllm architecture", arch, str(e), "leave architecture unset (derived from the model), "
                         "or pass the config.json of model.path") from None
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    return cfg


def served_config(args: ModelArgs, dtype: str, config: Mapping | None = None,
                  architecture: str | None = None) -> dict:
    """What the server loads: `config` (a checkpoint's config.json, e.g. `HFModel.config`) as is with only the
    dtype updated to the weights file's, else `hf_config(args, dtype, architecture)`."""
    if config is None:
        return hf_config(args, dtype, architecture)
    cfg = json.loads(json.dumps(dict(config)))  # a deep copy; fails here if it is not JSON
    archs = cfg.get("architectures")
    if architecture is not None and archs != [architecture]:
        raise TidalError("vllm architecture", architecture, f"differs from the config's architectures {archs}",
                         "leave architecture unset when passing a config")
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "dtype":
            cfg[key] = dtype
    return cfg


def check_served_config(model_dir: Path, args: ModelArgs) -> None:
    """The written config.json must describe exactly `args` (read back the way `model.path` is read), and be a
    model vLLM 0.32 builds the same way."""
    path = model_dir / "config.json"
    got = read_hf_config(model_dir, args.max_seq_len)
    if got.args != args:
        diff = {k: (getattr(got.args, k), getattr(args, k)) for k in args.__dataclass_fields__
                if getattr(got.args, k) != getattr(args, k)}
        raise TidalError("vllm config", diff, f"{path} describes another model than the weights' "
                         "(config value, model value)", "pass the args read from that config.json "
                         "(read_hf_config(model.path).args) with it")
    if got.architecture == "Qwen2ForCausalLM" and args.head_dim != args.hidden_size // args.num_heads:
        # vLLM's Qwen2 derives head_dim = hidden_size // num_heads and ignores config.json's head_dim
        raise TidalError("model.head_dim", args.head_dim, f"vLLM's Qwen2ForCausalLM always uses hidden_size // "
                         f"num_heads = {args.hidden_size // args.num_heads}", "use the native engine for this model")


def check_global_weights(args: ModelArgs, weights: Mapping[str, torch.Tensor]) -> None:
    specs = {s.name: s.shape for s in param_specs(args)}
    missing, extra = sorted(set(specs) - set(weights)), sorted(set(weights) - set(specs))
    if missing or extra:
        raise TidalError("weights", f"missing {missing[:4]}, unexpected {extra[:4]}",
                         "names must be exactly the model's parameter names (param_specs)",
                         "pass the global (tp=1) weights, e.g. rollout_shard(args, shards, 1, 0)")
    for name, shape in specs.items():
        if tuple(weights[name].shape) != shape:
            raise TidalError(f"weights[{name!r}]", tuple(weights[name].shape),
                             f"is not the global shape {shape}; the vLLM backend takes unsharded weights",
                             "pass rollout_shard(args, actor_shards, 1, 0); vLLM splits them for its own TP")


def write_hf_model(model_dir: Path, args: ModelArgs, weights: Mapping[str, torch.Tensor], dtype: str,
                   config: Mapping | None = None) -> None:
    """`config.json` (`config`, default `hf_config(args, dtype)`) + `model.safetensors` with HF names; the
    weights file is replaced atomically (rename)."""
    check_global_weights(args, weights)
    model_dir.mkdir(mode=0o700, exist_ok=True)
    tdtype = getattr(torch, dtype)
    tensors = {(n if n == "lm_head.weight" else f"model.{n}"): w.detach().to("cpu", tdtype).contiguous()
               for n, w in weights.items()}
    tmp = model_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, model_dir / "model.safetensors")
    cfg = hf_config(args, dtype) if config is None else config
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")


class _Server:
    """The child process and its JSON-lines channel (a reader thread turns stdout lines into a queue)."""

    def __init__(self, python: Path, env: dict[str, str], log_path: Path, timeout_s: float):
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - the child's stderr for its lifetime; close() closes it
        self.proc = subprocess.Popen([str(python), "-I", "-u", str(SERVER_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=str(log_path.parent))
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name="vllm-server-reader").start()
        self.hello = self._reply("start", timeout_s)

    def _read(self) -> None:
        for line in cast(IO[bytes], self.proc.stdout):  # stdout=PIPE
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _reply(self, op: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=min(5.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise VLLMServerError(f"vLLM server: no answer to {op!r} within {timeout_s:.0f} s; "
                                          f"log {self.log_path}:\n{self.log_tail()}") from None
                continue
            if line is None:
                code = self.proc.wait()
                raise VLLMServerError(f"vLLM server exited (code {code}) during {op!r}; "
                                      f"log {self.log_path}:\n{self.log_tail()}")
            return json.loads(line)

    def call(self, op: str, timeout_s: float, **fields) -> dict:
        if self.proc.poll() is not None:
            raise VLLMServerError(f"vLLM server is not running (exit {self.proc.returncode}); "
                                  f"log {self.log_path}:\n{self.log_tail()}")
        stdin = cast(IO[bytes], self.proc.stdin)  # stdin=PIPE
        stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        stdin.flush()
        reply = self._reply(op, timeout_s)
        if not reply.get("ok"):
            raise VLLMServerError(f"vLLM server failed {op!r}: {reply.get('type')}: {reply.get('error')}; "
                                  f"log {self.log_path}:\n{self.log_tail(15)}")
        return reply

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("shutdown", 30.0)
                self.proc.wait(timeout=30)
        except (VLLMServerError, OSError, subprocess.TimeoutExpired, ValueError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _cleanup(server: _Server, tmp: Path) -> None:
    server.close()
    shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class _Req:
    """Client-side state of one request in flight on the server (or frozen here by a migration)."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None
    frozen: bool = False
    gen_state: bytes | None = None  # set while frozen: the generator state to continue from
    migrations: int = 0
    started: bool = False  # a step has seen it (it is running, no longer waiting)


class VLLMEngine(GenerationEngine):
    """`hf_config`: the config.json to serve, e.g. a `model.path` checkpoint's (`HFModel` or its `.config`),
    kept as is (vocab padding, RoPE settings, token ids; only the dtype follows `config.dtype`); it must describe
    `args` exactly (read back with `read_hf_config`, else a TidalError). None: one generated from `args` by
    `hf_config` (family `architecture`, default `architecture_for(args)`: Qwen3 for q/k norms, Qwen2 for q/k/v
    bias, else Llama). Weights always arrive as global tensors (here and in `update_weights`)."""

    def __init__(self, args: ModelArgs, weights: Mapping[str, torch.Tensor], config: VLLMConfig = VLLMConfig(),
                 policy_version: int = 0, *, hf_config: HFModel | Mapping | None = None,
                 architecture: str | None = None):
        self.args, self.config, self._version = args, config, int(policy_version)
        python = config.interpreter()
        base = hf_config.config if isinstance(hf_config, HFModel) else hf_config
        self.hf_config = served_config(args, config.dtype, base, architecture)
        self.architecture = self.hf_config.get("architectures", ["?"])[0]
        self.tmp = Path(tempfile.mkdtemp(prefix="tidal-vllm-"))  # 0700: weights and log are private
        self.model_dir = self.tmp / "model"
        env = dict(os.environ)
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(int(config.kv_cache_gib)), "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "PYTHONNOUSERSITE": "1"})
        env.pop("PYTHONPATH", None)  # the server must see only .venv-vllm's packages
        if config.num_threads is not None:
            env.update({"OMP_NUM_THREADS": str(config.num_threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
        env.update(config.env)
        try:
            write_hf_model(self.model_dir, args, weights, config.dtype, self.hf_config)
            check_served_config(self.model_dir, args)
            self._server = _Server(python, env, self.tmp / "server.log", config.startup_timeout_s)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self._server, self.tmp)
        self.status = EngineStatus.READY
        self._live: dict[str, _Req] = {}
        self._gone: dict[str, str] = {}
        self.tokens_generated = 0
        self.info = self._load()

    def _load(self) -> dict:
        c = self.config
        return self._server.call("load", c.startup_timeout_s, model_dir=str(self.model_dir), dtype=c.dtype,
                                 max_num_seqs=c.max_running_requests, seed=c.seed, tp=c.tensor_parallel_size,
                                 max_model_len=self.args.max_seq_len)

    def close(self) -> None:
        """Stop the server and delete the temp dir (also done at garbage collection / exit)."""
        self._finalizer()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- queries -------------------------------------------------------------------------------------------
    def num_running(self) -> int:
        return sum(1 for r in self._live.values() if not r.frozen and r.started)

    def num_waiting(self) -> int:
        return sum(1 for r in self._live.values() if not r.frozen and not r.started)

    # ---- requests in -------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._check_new(request)
        self._check_request(request)
        req = _Req(request)
        self._send(req)
        self._live[request.request_id] = req
        self._gone.pop(request.request_id, None)

    def _check_request(self, request: Request) -> None:
        check_prompt(request, self.args)
        if request.params.temperature > VLLM_MAX_TEMPERATURE:
            raise TidalError("temperature", request.params.temperature,
                             f"request {request.request_id!r}: vLLM accepts temperatures up to {VLLM_MAX_TEMPERATURE}",
                             "lower rollout.temperature or use the native engine")

    def _send(self, req: _Req) -> None:
        """Hand a request to vLLM: fresh, or (migrated/cancelled) re-prefilled with its tokens so far."""
        r, p = req.request, req.request.params
        prompt = list(r.prompt_ids) + req.tokens
        max_tokens = min(p.max_new_tokens - len(req.tokens), self.args.max_seq_len - len(prompt))
        assert max_tokens >= 1, (r.request_id, len(req.tokens))  # _validate_state refuses finished states
        gen = None if req.gen_state is None else base64.b64encode(req.gen_state).decode()
        self._server.call("add", self.config.op_timeout_s, id=r.request_id, prompt_ids=prompt,
                          temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=max_tokens,
                          stop_token_ids=list(p.stop_token_ids), seed=r.seed, gen_state=gen)
        req.gen_state, req.started = None, False

    # ---- the loop ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestEvent]:
        self._need_ready("step")
        if not any(not r.frozen for r in self._live.values()):
            return []
        events: list[RequestEvent] = []
        for out in self._server.call("step", self.config.op_timeout_s)["outputs"]:
            rid = out["id"]
            req = self._live.get(rid)
            assert req is not None and not req.frozen, f"vLLM reported {rid!r}, which is not running here"
            req.started = True
            toks, lps = [int(t) for t in out["new_token_ids"]], [float(x) for x in out["new_logprobs"]]
            assert len(toks) == len(lps), (rid, toks, lps)
            if toks and req.version is None:
                req.version = self._version
            req.tokens += toks
            req.logprobs += lps
            self.tokens_generated += len(toks)
            new: tuple[tuple[int, ...], tuple[float, ...]] = \
                (tuple(toks), tuple(lps)) if req.request.stream else ((), ())
            reason = out["finish_reason"]
            if reason is None:
                if req.request.stream and toks:
                    events.append(RequestEvent(rid, *new))
                continue
            if reason not in ("stop", "length"):
                raise VLLMServerError(f"step: vLLM finished {rid!r} with reason {reason!r}; expected stop/length")
            result = RequestResult(rid, req.request.prompt_ids, tuple(req.tokens), tuple(req.logprobs), reason,
                                   cast(int, req.version), req.migrations)  # set with its first token
            self._forget(rid, "finished")
            events.append(RequestEvent(rid, *new, result=result))
        return events

    def _forget(self, rid: str, why: str) -> None:
        del self._live[rid]
        self._gone[rid] = why

    # ---- abort and migration -----------------------------------------------------------------------------
    def abort(self, ids: Sequence[str]) -> None:
        ids = self._check_ids("abort", ids, None)
        on_server = [rid for rid in ids if not self._live[rid].frozen]
        if on_server:
            self._server.call("abort", self.config.op_timeout_s, ids=on_server)
        for rid in ids:
            self._forget(rid, "aborted")

    def export_state(self, ids: Sequence[str], in_place: bool = False) -> list[RequestState]:
        """Freeze: vLLM gives up the requests (abort) after reporting their generator states; no KV leaves
        (`in_place` changes nothing: there is no pool to name blocks of)."""
        self._need_ready("export_state")
        ids = self._check_ids("export_state", ids, False)
        states = self._server.call("export", self.config.op_timeout_s, ids=ids)["states"] if ids else {}
        out = []
        for rid in ids:
            req = self._live[rid]
            raw = states.get(rid)
            # no generator in vLLM (greedy, or not scheduled yet): the seeded start state, as the native engine has
            gen = (torch.Generator().manual_seed(req.request.seed).get_state() if raw is None
                   else torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.uint8).clone())
            req.frozen, req.gen_state = True, gen.numpy().tobytes()
            out.append(RequestState(req.request, list(req.tokens), list(req.logprobs), gen, req.version,
                                    None, 0, "", req.migrations))
        return out

    def commit_export(self, ids: Sequence[str]) -> None:
        for rid in self._check_ids("commit_export", ids, True):
            self._forget(rid, "migrated away")

    def cancel_export(self, ids: Sequence[str]) -> None:
        """The target failed: continue here, re-prefilled from the frozen tokens and generator state."""
        for rid in self._check_ids("cancel_export", ids, True):
            self._unfreeze(self._live[rid])

    def activate(self, ids: Sequence[str]) -> None:
        for rid in self._check_ids("activate", ids, True):
            self._unfreeze(self._live[rid])

    def _unfreeze(self, req: _Req) -> None:
        self._need_ready("activate")
        self._send(req)
        req.frozen = False

    def import_state(self, states: Sequence[RequestState], staged: bool = False) -> None:
        """All or nothing. KV in a state is ignored (vLLM re-prefills prompt + generated tokens)."""
        self._need_ready("import_state")
        reqs = [self._validate_state(st, [s.request_id for s in states]) for st in states]
        for req in reqs:
            req.frozen = True
            self._live[req.request.request_id] = req
            self._gone.pop(req.request.request_id, None)
        if not staged:
            for req in reqs:
                self._unfreeze(req)

    def _validate_state(self, st: RequestState, batch_ids: list[str]) -> _Req:
        where = check_importable(st, batch_ids, self._live, self._version)
        self._check_request(st.request)
        p, n = st.request.params, len(st.token_ids)
        total = len(st.request.prompt_ids) + n
        finished = n >= p.max_new_tokens or total >= self.args.max_seq_len or (
            n > 0 and st.token_ids[-1] in p.stop_token_ids)
        if len(st.logprobs) != n or finished:
            raise GenerationError(f"{where}: {n} tokens, {len(st.logprobs)} log-probs, max_new_tokens="
                                  f"{p.max_new_tokens}, max_seq_len={self.args.max_seq_len}: the state is corrupt "
                                  "or already finished")
        bad = [t for t in st.token_ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise GenerationError(f"{where}: generated ids {bad[:5]} outside the vocab [0, {self.args.vocab_size})")
        gen = st.generator_state.to("cpu", torch.uint8).contiguous()
        try:  # a CPU torch.Generator state (what vLLM's CPU runner uses); refuse anything else here, not in vLLM
            torch.Generator().set_state(gen)
        except RuntimeError as e:
            raise GenerationError(f"{where}: generator_state is not a CPU torch.Generator state ({e})") from None
        return _Req(st.request, list(st.token_ids), list(st.logprobs), st.policy_version, True,
                    gen.numpy().tobytes(), st.num_migrations + 1, False)

    # ---- weights and memory ------------------------------------------------------------------------------
    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int,
                       in_flight: Literal["keep", "recompute"] | None = None) -> None:
        """Write the new global weights to the private model dir; the server reloads them in place. The server
        reloads only between requests: a partial rollout (`in_flight`) is the native engine's."""
        self._need_ready("update_weights")
        if in_flight is not None:
            raise GenerationError(f"update_weights(in_flight={in_flight!r}): the vLLM backend reloads weights only "
                                  "with no request in flight; finish or export them first")
        self._need_idle("update_weights")
        self._check_version(version)
        write_hf_model(self.model_dir, self.args, weights, self.config.dtype, self.hf_config)
        self._server.call("reload", self.config.op_timeout_s, model_dir=str(self.model_dir))
        self._version = version

    def release_memory(self, offload: bool = False) -> None:
        """Drop the vllm.LLM (weights + KV cache freed in the server). `offload`: keep the weights file for
        `resume()`; else it is deleted and resume needs weights."""
        self._need_idle("release_memory")
        self._move(EngineStatus.RELEASED, "release_memory")
        self._server.call("release", self.config.op_timeout_s)
        if not offload:
            (self.model_dir / "model.safetensors").unlink(missing_ok=True)

    def resume(self, weights: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        self._check_resume(weights, version, kept=(self.model_dir / "model.safetensors").exists())
        if weights is not None:
            write_hf_model(self.model_dir, self.args, weights, self.config.dtype, self.hf_config)
        self.info = self._load()
        if version is not None:
            self._version = version
        self._move(EngineStatus.READY, "resume")

