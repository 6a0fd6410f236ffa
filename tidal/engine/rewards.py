"""Verifiable reward functions for RL on GSM8K- and MATH-style data, and a scorer that runs them under a timeout.

Every reward function has verl's signature and returns a float (1.0 correct, 0.0 otherwise for the builtins):

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float

Builtins (`BUILTIN`, picked by name in `reward.function`):

    name          reads from the response                          compares with
    gsm8k         the number after the last '#### ', else the      Decimal equality after normalising both
                  last number anywhere in the text                  sides ('$' and ',' dropped)
    gsm8k_strict  only the number after the last '#### '            same
    math          the content of the last \\boxed{...} / \\fbox{}   math_verify (symbolic / numeric equality)
    exact         the whole response, stripped                     the ground truth, stripped

Worked examples:

    gsm8k         "The answer is $1,234.00"      vs "1234"                        -> 1.0
    gsm8k         "It is 3, no wait, 4."         vs "4"                           -> 1.0  (last number)
    gsm8k         "#### 7"                       vs "Natalia sold ... #### 72"    -> 0.0  (gold after '####')
    gsm8k_strict  "The answer is 72"             vs "72"                          -> 0.0  (no '####')
    math          "so \\boxed{0.5}"               vs "\\frac12"                     -> 1.0
    math          "\\boxed{1} then \\boxed{2}"     vs "\\boxed{2}"                   -> 1.0  (last box, gold unboxed)
    math          "the answer is 1/2"            vs "\\frac12"                     -> 0.0  (no box)

Numbers (gsm8k): optional '-' (not taken after a letter, digit or ')', so "10-7" reads 7), optional '$',
digits with ',' thousands groups, optional decimals. A sentence's final period is not part of a number.
A ground truth may be a bare number ("1,234") or a full GSM8K answer ending in "#### 1234"; a ground truth
with no number raises ValueError (a data bug, surfaced as RewardError by the scorer), a response with no
number scores 0.0.

Math: the boxed answer and the gold (its last box if it has one, else the whole string) are first
compared as text with whitespace removed (1.0 without importing sympy); otherwise both are parsed by
`math_verify.parse` (LaTeX, then plain expressions) and compared by `math_verify.verify`. math_verify's
own timeouts use `signal.alarm`, which works only in a main thread; ours run in Ray worker threads, so they
are disabled (`parsing_timeout=None`, `timeout_seconds=None`) and `RewardScorer` bounds the time instead.

Custom functions: `reward.function: "package.module:function"` (dotted attribute allowed), imported with
importlib; file paths are not accepted. `resolve_reward` turns every bad spec into a TidalError, including a
function that cannot be called as `fn(data_source, solution_str, ground_truth, extra_info)` (checked with
`inspect.signature(fn).bind`, four positional arguments, as the scorer calls it).

Before a run (`check_reward`, from the driver's preflight): a builtin is resolved in place; a custom module is
imported in a short-lived child process, never in the driver, so a module that hangs, exits or crashes while it
imports is an error naming it ("importing M did not finish in N s", "the process exited with code 3 while
importing M") and the driver lives on. The import gets `reward.timeout_s`; the child's own interpreter start-up
gets `STARTUP_TIMEOUT_S`, apart.

Ground truths (`ground_truth_check`): for a builtin, why it can never pay a ground truth (gsm8k: there is no
number to read; math, exact: it is empty), read the way the verifier reads it; None for a custom function (opaque).

Timeout mechanism (`RewardScorer`):
  - "exact", "gsm8k", "gsm8k_strict" run inline: regex + Decimal code, linear in the response length.
  - "math" and custom functions run in one child process (multiprocessing "spawn": a fresh interpreter that
    inherits no sockets, CUDA state or threads), started at the first call and kept for later calls. The
    child gets the spec string and the parent's `sys.path` (behind its environment's PYTHONPATH), imports the
    function itself (nothing unpicklable crosses) and signals ready; start-up (imports, math_verify warm-up)
    is bounded by `STARTUP_TIMEOUT_S` (or `timeout_s` when longer: an import `check_reward` accepted fits),
    not by the per-call timeout. Each call then sends the four arguments over a Pipe
    and waits at most `timeout_s` for the answer.
  - On timeout the child is terminated (SIGTERM, then SIGKILL), `num_timeouts` grows, the call returns
    `RewardResult(0.0, timed_out=True)` and the next call starts a fresh child.
  - A function that raises, or returns anything but a finite real number of magnitude at most `MAX_ABS_REWARD`
    (bool counts; None, str, NaN, inf, 1e308 do not), raises `RewardError` naming the sample id, the spec and
    the error or value. The child survives it. The bound keeps a group's mean and spread (GRPO's advantages,
    float64 sums over a group) finite: every reward a run scores, builtin or custom, passes here.
  - The child is a daemon process: it dies with the scorer's process, and so cannot itself start
    multiprocessing children (subprocess is fine). Calls on one scorer are serialised by a lock.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import multiprocessing
import numbers
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from multiprocessing.connection import Connection
from typing import Any, Protocol

from tidal.core.errors import TidalError

FIELD = "reward.function"
STARTUP_TIMEOUT_S = 60.0
#: Largest reward magnitude accepted: far above any verifier's scale, far below float overflow in a group's sums.
MAX_ABS_REWARD = 1e6
# Seconds a terminated child gets to exit before SIGKILL.
_KILL_GRACE_S = 1.0


class RewardError(TidalError):
    """A reward function raised, or returned something that is not a score, for one sample."""


@dataclass(frozen=True)
class RewardResult:
    score: float
    timed_out: bool = False


class RewardFunction(Protocol):
    def __call__(self, data_source: str, solution_str: str, ground_truth: str,
                 extra_info: dict | None = None) -> float: ...


# ---------------------------------------------------------------------------------------------- gsm8k

# A number: '-' only when not glued to a preceding word/number (ranges, subtractions), then '$', then either
# comma-grouped thousands or plain digits, then decimals that need a digit after the point (so "4." is 4).
# No nested quantifiers: matching is linear in the text length.
# ASCII digits only: Decimal() must accept every match.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?", re.ASCII)
_HASH_ANSWER = re.compile(r"####\s*(" + _NUMBER.pattern + ")", re.ASCII)


def _to_decimal(number: str) -> Decimal:
    return Decimal(number.replace("$", "").replace(",", ""))


def _last_number(text: str) -> Decimal | None:
    matches = _NUMBER.findall(text)
    return _to_decimal(matches[-1]) if matches else None


def _hash_answer(text: str) -> Decimal | None:
    matches = _HASH_ANSWER.findall(text)
    return _to_decimal(matches[-1]) if matches else None


def _gsm8k_gold(ground_truth: str) -> Decimal:
    text = ground_truth.rpartition("####")[2] if "####" in ground_truth else ground_truth
    gold = _last_number(text)
    if gold is None:
        raise ValueError(f"ground truth {ground_truth[-80:]!r} has no number")
    return gold


def _equal(answer: Decimal | None, gold: Decimal) -> float:
    return 1.0 if answer is not None and answer == gold else 0.0


def gsm8k_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the last '#### N' (else the last number in the text) equals the gold number."""
    answer = _hash_answer(solution_str)
    if answer is None:
        answer = _last_number(solution_str)
    return _equal(answer, _gsm8k_gold(ground_truth))


def gsm8k_strict_score(data_source: str, solution_str: str, ground_truth: str,
                       extra_info: dict | None = None) -> float:
    """1.0 if the last '#### N' equals the gold number; a response without '#### N' scores 0.0."""
    return _equal(_hash_answer(solution_str), _gsm8k_gold(ground_truth))


# ----------------------------------------------------------------------------------------------- math

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at text[start] == '{'; None if it never closes."""
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # an escaped char (\{, \}, \\) never opens or closes a group
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (or `\\boxed x`: one token); None if absent or unclosed."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = start + len(command)
    if rest < len(text) and text[rest].isalpha():
        return None  # a longer command (\boxedx...): not a box
    stripped = text[rest:].lstrip()
    if stripped.startswith("{"):
        return _braced(stripped, 0)
    token = re.match(r"[^\s$]+", stripped)
    return token.group(0) if token else None


def _compact(latex: str) -> str:
    return "".join(latex.split()).strip("$")


def _math_equal(gold: str, answer: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify  # pulls sympy: lazy

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    # Timeouts off: math_verify's use signal.alarm (main thread only); RewardScorer bounds the time.
    parsed_gold = parse(f"${gold}$", extraction_config=config, parsing_timeout=None)
    if not parsed_gold:
        parsed_gold = parse(gold, extraction_config=config, parsing_timeout=None)
    parsed_answer = parse(f"${answer}$", extraction_config=config, parsing_timeout=None)
    if not parsed_gold or not parsed_answer:
        return False
    return bool(verify(parsed_gold, parsed_answer, timeout_seconds=None))


def math_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the last \\boxed{} of the response equals the ground truth (bare or boxed) per math_verify."""
    answer = last_boxed(solution_str)
    if answer is None or not answer.strip():
        return 0.0
    gold = last_boxed(ground_truth) if any(c in ground_truth for c in _BOX_COMMANDS) else None
    gold = ground_truth if gold is None else gold
    if _compact(answer) == _compact(gold):
        return 1.0
    return 1.0 if _math_equal(gold, answer) else 0.0


# ---------------------------------------------------------------------------------------------- exact

def exact_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 if the stripped response equals the stripped ground truth."""
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0


BUILTIN: dict[str, RewardFunction] = {
    "gsm8k": gsm8k_score,
    "gsm8k_strict": gsm8k_strict_score,
    "math": math_score,
    "exact": exact_score,
}
# Bounded-cost builtins: RewardScorer runs these in the calling thread.
INLINE = frozenset({"exact", "gsm8k", "gsm8k_strict"})
_FIX = "fix the reward function, or choose a builtin: " + ", ".join(sorted(BUILTIN))
_CUSTOM_SPEC = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


# ------------------------------------------------------------------------------------- ground truths

def _gsm8k_gold_problem(ground_truth: str) -> str | None:
    try:
        _gsm8k_gold(ground_truth)
    except ValueError:
        where = "after its last '####'" if "####" in ground_truth else "in it"
        return f"{ground_truth[-80:]!r} has no number {where}: the gsm8k verifiers can never pay it"
    return None


def _math_gold_problem(ground_truth: str) -> str | None:
    gold = last_boxed(ground_truth) if any(c in ground_truth for c in _BOX_COMMANDS) else None
    if not _compact(ground_truth if gold is None else gold):
        return f"{ground_truth[-80:]!r} is empty (or an empty box): the math verifier can never pay it"
    return None


def _exact_gold_problem(ground_truth: str) -> str | None:
    if not ground_truth.strip():
        return "is empty: the exact verifier would pay only an empty response"
    return None


_GOLD_PROBLEMS: dict[str, Callable[[str], str | None]] = {
    "gsm8k": _gsm8k_gold_problem, "gsm8k_strict": _gsm8k_gold_problem, "math": _math_gold_problem,
    "exact": _exact_gold_problem,
}
assert set(_GOLD_PROBLEMS) == set(BUILTIN), "every builtin says which ground truths it can pay"


def ground_truth_check(spec: str) -> Callable[[str], str | None] | None:
    """For a builtin verifier: a function saying why the verifier can never pay a ground truth (None: it can),
    read exactly as the verifier reads it. None for a custom function, which is opaque."""
    return _GOLD_PROBLEMS.get(spec)


# -------------------------------------------------------------------------------------------- resolve

def _spec_fix() -> str:
    return f"use a builtin ({', '.join(sorted(BUILTIN))}) or 'package.module:function' importable on sys.path"


def resolve_reward(spec: str, field: str = FIELD) -> RewardFunction:
    """A builtin name, or 'package.module:function' imported with importlib; anything else is a TidalError."""
    if not isinstance(spec, str):
        raise TidalError(field, spec, "a reward function is named by a string", _spec_fix())
    if ":" not in spec:
        if spec in BUILTIN:
            return BUILTIN[spec]
        close = difflib.get_close_matches(spec, list(BUILTIN), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TidalError(field, spec, "unknown builtin reward function", hint + _spec_fix())
    _check_custom_spec(spec, field)
    module_name, _, attr_path = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raises while it runs
        raise TidalError(field, spec, f"module {module_name!r} cannot be imported: {type(err).__name__}: {err}",
                         "install the package or put it on PYTHONPATH, or " + _spec_fix()) from err
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise TidalError(field, spec, f"{module_name!r} has no attribute {attr_path!r}",
                             f"name a function defined in {module_name}, or " + _spec_fix())
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TidalError(field, spec, f"{attr_path!r} is a {type(obj).__name__}, not callable",
                         "name a function (data_source, solution_str, ground_truth, extra_info) -> float")
    _check_signature(obj, spec, attr_path, field)
    return obj


def _check_custom_spec(spec: str, field: str) -> None:
    if not _CUSTOM_SPEC.fullmatch(spec):
        raise TidalError(field, spec, "not of the form 'package.module:function' (file paths are not accepted)",
                         _spec_fix())


def _check_signature(fn: Callable[..., object], spec: str, name: str, field: str) -> None:
    """`fn` accepts the scorer's call, fn(data_source, solution_str, ground_truth, extra_info), all positional."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some C functions): the first call will tell
        return
    try:
        signature.bind("data_source", "solution_str", "ground_truth", None)
    except TypeError as err:
        raise TidalError(field, spec, f"{name}{signature} cannot be called as {name}(data_source, solution_str, "
                         f"ground_truth, extra_info): {err}",
                         "give it verl's signature: def compute_score(data_source, solution_str, ground_truth, "
                         "extra_info=None)") from None


# ------------------------------------------------------------------------------------- check before a run

def check_reward(spec: str, timeout_s: float, field: str = FIELD) -> None:
    """`spec` names a reward function the scorer can run: a builtin, or a custom one whose module imports within
    `timeout_s` in a child process (see the module doc) and whose function takes verl's four arguments. Every
    failure is a TidalError naming `field`; the driver imports nothing of the custom module."""
    if not isinstance(spec, str) or ":" not in spec:
        resolve_reward(spec, field)
        return
    _check_custom_spec(spec, field)
    module_name = spec.partition(":")[0]
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    # the search path of a worker: Ray starts workers in the driver's working directory, which they import from
    process = ctx.Process(target=_probe_main, args=(child_conn, spec, field, [*sys.path, os.getcwd()]),
                          name=f"reward-check:{spec}", daemon=True)
    process.start()
    child_conn.close()  # the child holds its own copy; closing ours lets recv() see EOF if it dies
    try:
        started = _probe_answer(process, parent_conn, STARTUP_TIMEOUT_S)
        if started is None:
            raise TidalError(field, spec, f"the reward process did not start within {STARTUP_TIMEOUT_S:g} s",
                             "check the machine's load, then validate again")
        if isinstance(started, _ProbeEnded):
            raise TidalError(field, spec, f"the reward process {started} before importing {module_name}",
                             "check the Python environment (python -c 'import tidal.engine.rewards')")
        done = _probe_answer(process, parent_conn, timeout_s)
        if done is None:
            raise TidalError(field, spec, f"importing {module_name} did not finish in {timeout_s:g} s",
                             "make the module's import quick (move slow work into the function, or do it once "
                             "on its first call), or raise reward.timeout_s")
        if isinstance(done, _ProbeEnded):
            raise TidalError(field, spec, f"the process {done} while importing {module_name}",
                             f"make {module_name} importable without exiting (python -c 'import {module_name}' "
                             "shows what it does)")
        if isinstance(done, TidalError):
            raise done
        assert done == _IMPORTED, done
    finally:
        _stop_child(process, parent_conn, graceful=False)


_STARTED, _IMPORTED = "started", "imported"  # the probe's messages; a TidalError is its third


@dataclass(frozen=True)
class _ProbeEnded:
    """The probe process ended without a message: its exit code (negative: the signal that killed it)."""

    code: int

    def __str__(self) -> str:
        return f"was killed by signal {-self.code}" if self.code < 0 else f"exited with code {self.code}"


def _probe_answer(process: multiprocessing.process.BaseProcess, conn: Connection,
                  timeout_s: float) -> str | TidalError | _ProbeEnded | None:
    """The probe's next message, how it ended instead, or None when `timeout_s` passed first."""
    if not conn.poll(timeout_s):
        return None
    try:
        return conn.recv()
    except EOFError:
        process.join(_KILL_GRACE_S)
        return _ProbeEnded(process.exitcode if process.exitcode is not None else -9)


def _probe_main(conn: Connection, spec: str, field: str, parent_path: list[str]) -> None:
    """Child process of `check_reward`: say it started, import and check the function, say it imported (or send
    the TidalError), then end."""
    _extend_path(parent_path)
    conn.send(_STARTED)
    try:
        resolve_reward(spec, field)
    except TidalError as err:
        conn.send(err)
        return
    except BaseException as err:  # what the module raised while it ran and resolve_reward lets pass: SystemExit
        module_name = spec.partition(":")[0]
        conn.send(TidalError(field, spec, f"importing {module_name} raised {type(err).__name__}: {err}",
                             f"make {module_name} importable without exiting, or " + _spec_fix()))
        return
    conn.send(_IMPORTED)


# ------------------------------------------------------------------------------------------ the scorer

def _as_score(value: object) -> float | None:
    """The float score, or None when `value` is not a finite real number within MAX_ABS_REWARD (bool is one)."""
    if not isinstance(value, numbers.Real):
        return None
    score = float(value)
    return score if math.isfinite(score) and abs(score) <= MAX_ABS_REWARD else None


def _call(fn: Callable[..., object], args: tuple) -> tuple[str, object]:
    """('ok', float) | ('raised', 'Type: message') | ('bad', repr of the returned value)."""
    try:
        value = fn(*args)
    except Exception as err:
        return "raised", f"{type(err).__name__}: {err}"
    score = _as_score(value)
    return ("ok", score) if score is not None else ("bad", repr(value)[:200])


def _extend_path(parent_path: list[str]) -> None:
    """Puts the reward module's search path in front of this child's sys.path: the PYTHONPATH of its environment,
    as a freshly started interpreter (a worker) reads it, then the parent's sys.path. multiprocessing's spawn gives
    the child the parent's sys.path alone, which lacks a PYTHONPATH entry set after the parent started."""
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in reversed(list(dict.fromkeys(pythonpath + parent_path))):
        if entry not in sys.path:
            sys.path.insert(0, entry)


def _child_main(conn: Connection, spec: str, parent_path: list[str]) -> None:
    """Child process: import the function by its spec, say 'ready', then answer calls until EOF or None."""
    _extend_path(parent_path)
    try:
        fn = resolve_reward(spec)
        if spec == "math":
            math_score("", "\\boxed{1}", "2")  # imports sympy and compiles math_verify's regexes now, untimed
    except Exception as err:
        conn.send(("raised", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):  # the parent closed its end, or died (killed: the connection is reset)
            return
        if args is None:
            return
        try:
            conn.send(_call(fn, args))
        except OSError:  # the parent died while the call ran
            return


@dataclass
class _Child:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    stop: weakref.finalize


def _stop_child(process: multiprocessing.process.BaseProcess, conn: Connection, graceful: bool) -> None:
    if graceful and process.is_alive():
        try:
            conn.send(None)
            process.join(_KILL_GRACE_S)
        except OSError:
            pass
    if process.is_alive():
        process.terminate()
        process.join(_KILL_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


class RewardScorer:
    """Scores responses with one reward function, under a per-call timeout."""

    def __init__(self, spec: str, timeout_s: object = 10.0):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
                or not 0 < float(timeout_s) < math.inf:
            raise TidalError("reward.timeout_s", timeout_s, "must be a positive number of seconds",
                             "set reward.timeout_s to e.g. 10")
        self.spec = spec
        self.timeout_s = float(timeout_s)
        self._startup_s = max(STARTUP_TIMEOUT_S, self.timeout_s)  # an import check_reward accepted fits
        self._fn = resolve_reward(spec)  # validates the spec in this process, so a bad one fails at start
        self._inline = spec in INLINE
        self._child: _Child | None = None
        self._num_timeouts = 0
        self._lock = threading.Lock()  # one request in flight per pipe

    @property
    def num_timeouts(self) -> int:
        return self._num_timeouts

    def score(self, sample_id: str, data_source: str, solution_str: str, ground_truth: str,
              extra_info: dict | None = None) -> RewardResult:
        args = (data_source, solution_str, ground_truth, extra_info)
        with self._lock:
            if self._inline:
                kind, payload = _call(self._fn, args)
            else:
                answer = self._call_child(sample_id, args)
                if answer is None:
                    self._num_timeouts += 1
                    return RewardResult(0.0, timed_out=True)
                kind, payload = answer
        if kind == "raised":
            raise self._error(sample_id, f"reward function raised {payload}")
        if kind == "bad":
            raise self._error(sample_id, f"reward function returned {payload}, not a finite real number of "
                              f"magnitude at most {MAX_ABS_REWARD:g}")
        assert kind == "ok" and isinstance(payload, float), (kind, payload)
        return RewardResult(payload)

    def close(self) -> None:
        """Stops the child, if any; a later score() starts a new one."""
        with self._lock:
            if self._child is not None:
                self._child.stop()
                self._child = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, sample_id: str, what: str) -> RewardError:
        return RewardError(FIELD, self.spec, f"sample {sample_id!r}: {what}", _FIX)

    def _kill_child(self) -> None:
        assert self._child is not None
        self._child.stop.detach()
        _stop_child(self._child.process, self._child.conn, graceful=False)
        self._child = None

    def _start_child(self, sample_id: str) -> _Child:
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(target=_child_main, args=(child_conn, self.spec, list(sys.path)),
                              name=f"reward:{self.spec}", daemon=True)
        process.start()
        child_conn.close()  # the child holds its own copy; closing ours lets recv() see EOF if it dies
        # Finalizer holds no reference to self: a scorer dropped without close() still stops its child.
        stop = weakref.finalize(self, _stop_child, process, parent_conn, True)
        self._child = _Child(process, parent_conn, stop)
        if not parent_conn.poll(self._startup_s):
            self._kill_child()
            raise self._error(sample_id, f"reward process did not start within {self._startup_s:g} s")
        try:
            kind, payload = parent_conn.recv()
        except EOFError:
            code = process.exitcode
            self._kill_child()
            raise self._error(sample_id, f"reward process exited while starting (exit code {code})") from None
        if kind != "ready":
            self._kill_child()
            raise self._error(sample_id, f"reward process failed to start: {payload}")
        return self._child

    def _call_child(self, sample_id: str, args: tuple) -> tuple[str, object] | None:
        """The child's answer, or None on timeout (the child is then gone)."""
        child = self._child if self._child is not None else self._start_child(sample_id)
        try:
            child.conn.send(args)
        except (OSError, EOFError):  # the child died between calls: a fresh one takes this call
            self._kill_child()
            child = self._start_child(sample_id)
            child.conn.send(args)
        if not child.conn.poll(self.timeout_s):
            self._kill_child()
            return None
        try:
            return child.conn.recv()
        except EOFError:
            child.process.join(_KILL_GRACE_S)
            code = child.process.exitcode
            self._kill_child()
            raise self._error(sample_id, f"reward process exited during the call (exit code {code})") from None
