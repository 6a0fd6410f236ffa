"""Tasks with verifiable rewards: prompts, answers, a 0/1 verifier, seeded disjoint train/held-out splits.

Built-in tasks (all use `tidal/engine/tokenizer.py`'s default alphabet; answers are written as text, then `<eos>`):

    name            prompt        answer   rule
    addition        "123+456="    "975"    a + b, a, b 3-digit; the sum written least-significant digit first
    multiplication  "347*8="      "6772"   a x b, a 3-digit, b in 2..9; product least-significant digit first
    sorting         "315926:"     "123569" the 6 digits in ascending order

Why LSD-first: each answer digit then depends only on the operand digits at the same place and on the
carry from the digit just written, so a small causal decoder can compute it left to right. Measured here:
a 0.8M-parameter model learns 3-digit addition in minutes on a CPU with LSD-first answers; MSD-first
barely learns. Operands stay MSD-first (ordinary numbers), fixed width.

Reward (`verify`): 1.0 if the response text, cut at its first `<eos>`, equals the answer exactly, else 0.0.
A response without `<eos>` (truncated at the length cap) scores 0; so do extra characters, spaces,
leading zeros that the answer does not have, and anything unparseable. Nothing after `<eos>` is read.
Decode responses with `CharTokenizer.decode(ids)` (specials kept) so the `<eos>` is there to find.

Splits: every task enumerates its prompt space (`prompt_at(index)`, index in `[0, num_prompts)`). A
problem is held out iff `hash(seed, problem_key) < heldout_fraction`, with a fixed 64-bit mixer (not
Python's salted `hash`), so the split is a pure function of the seed on every machine. The problem key
puts `a+b` and `b+a` on the same side, so "held out" means an unseen problem, not an unseen ordering.
Held-out and train prompts are disjoint by construction; the streams below draw from one side each.

    train_prompts(n, seed, start)  the RL stream: prompt k (k = start, start+1, ...) is drawn uniformly from
                                   the train side by a generator keyed on (seed, k): random access, so the
                                   data position to checkpoint or reshard is the integer `start`.
    heldout_prompts(n, seed)       n distinct held-out prompts; a prefix of a longer call with the same seed.
    sft_examples(n, seed)          n distinct train prompts with their answers: a deliberately small
                                   supervised warm start (the RL stream may also visit them: both are train).

Registry: `get_task(name)`; unknown names fail with a did-you-mean, duplicate registrations fail.
"""

from __future__ import annotations

import difflib
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

from tidal.core.errors import TidalError
from tidal.engine.tokenizer import EOS, CharTokenizer

_M64 = (1 << 64) - 1
# Stream tags: each use of the seed draws from its own generator.
_SPLIT, _TRAIN, _HELDOUT, _SFT = 1, 2, 3, 4


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(*parts: int) -> int:
    """A 64-bit hash of a tuple of ints, the same on every platform and Python process."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (p & _M64))
    return h


def verify(answer: str, response_text: str) -> float:
    """1.0 iff `response_text` up to its first `<eos>` is exactly `answer` (and an `<eos>` is present)."""
    head, sep, _ = response_text.partition(EOS)
    return 1.0 if sep and head == answer else 0.0


@dataclass(frozen=True)
class SFTExample:
    """One supervised pair: `prompt` text and the `response` text the model should write (no `<eos>`)."""

    prompt: str
    response: str

    def token_ids(self, tokenizer: CharTokenizer) -> tuple[list[int], list[int]]:
        """(`<bos>` + prompt, response + `<eos>`), the layout of a rollout."""
        return tokenizer.encode(self.prompt, add_bos=True), tokenizer.encode(self.response, add_eos=True)


class Task(ABC):
    """A prompt space with a checkable answer. Subclasses define the space and the answer rule."""

    name: str
    heldout_fraction: float = 0.1
    chars: str  # the characters prompts and answers use

    @property
    @abstractmethod
    def num_prompts(self) -> int:
        """Size of the prompt space."""

    @abstractmethod
    def prompt_at(self, index: int) -> str:
        """The prompt text of `index` in `[0, num_prompts)` (a bijection)."""

    @abstractmethod
    def answer(self, prompt: str) -> str:
        """The exact expected response text (without `<eos>`). ValueError if `prompt` is not of this task."""

    @property
    @abstractmethod
    def max_answer_chars(self) -> int:
        """Longest answer, in characters (= tokens)."""

    def problem_key(self, index: int) -> int:
        """Prompts with equal keys fall on the same side of the split (default: each prompt its own)."""
        return index

    # ---- derived ----------------------------------------------------------------------------------
    @property
    def max_response_tokens(self) -> int:
        """Tokens a correct response needs: the longest answer plus `<eos>` (a floor for max_new_tokens)."""
        return self.max_answer_chars + 1

    def reward(self, prompt: str, response_text: str) -> float:
        """The verifier: `verify(answer(prompt), response_text)`."""
        return verify(self.answer(prompt), response_text)

    def prompt_ids(self, prompt: str, tokenizer: CharTokenizer) -> list[int]:
        return tokenizer.encode(prompt, add_bos=True)

    def check_tokenizer(self, tokenizer: CharTokenizer) -> None:
        missing = sorted(set(self.chars) - set(tokenizer.chars))
        if missing:
            raise TidalError("tokenizer", repr(tokenizer.chars), f"lacks characters {missing} of task {self.name!r}",
                             "use the default tokenizer (tidal/engine/tokenizer.py) or one whose chars include them")

    # ---- splits -----------------------------------------------------------------------------------
    def is_heldout(self, index: int, seed: int) -> bool:
        # Top 53 bits as a uniform float in [0, 1).
        return (_mix(seed, _SPLIT, self.problem_key(index)) >> 11) * 2.0 ** -53 < self.heldout_fraction

    def train_prompts(self, n: int, seed: int, start: int = 0) -> list[str]:
        """Prompts `start .. start+n-1` of the seeded train stream (uniform over the train side, with
        repeats across positions)."""
        _check_count("n", n)
        _check_count("start", start)
        out = []
        for k in range(start, start + n):
            attempt = 0
            while True:  # rejection: about 1 / (1 - heldout_fraction) draws
                idx = _mix(seed, _TRAIN, k, attempt) % self.num_prompts
                if not self.is_heldout(idx, seed):
                    break
                attempt += 1
            out.append(self.prompt_at(idx))
        return out

    def heldout_prompts(self, n: int, seed: int) -> list[str]:
        """`n` distinct held-out prompts, in a seeded order."""
        _check_count("data.eval_size", n)
        return [self.prompt_at(i) for i in self._distinct(n, seed, _HELDOUT, heldout=True)]

    def sft_examples(self, n: int, seed: int) -> list[SFTExample]:
        """`n` distinct train prompts with their answers, for a small supervised warm start."""
        _check_count("n", n)
        return [SFTExample(p, self.answer(p))
                for p in map(self.prompt_at, self._distinct(n, seed, _SFT, heldout=False))]

    def _distinct(self, n: int, seed: int, tag: int, heldout: bool) -> list[int]:
        chosen: dict[int, None] = {}  # insertion-ordered set
        attempt, patience = 0, 8 * n / min(self.heldout_fraction, 1 - self.heldout_fraction) + 1000
        while len(chosen) < n:
            idx = _mix(seed, tag, attempt) % self.num_prompts
            if self.is_heldout(idx, seed) == heldout:
                chosen.setdefault(idx, None)
            attempt += 1
            if attempt > patience:  # slow progress: is the side even large enough?
                side = self._side_size(seed, heldout)
                if side < n:
                    which = "held-out" if heldout else "train"
                    raise TidalError("data.eval_size" if heldout else "n", n,
                                     f"exceeds the {side} {which} prompts of task {self.name!r} (seed {seed})",
                                     f"ask for at most {side}")
                patience = float("inf")
        return list(chosen)

    def _side_size(self, seed: int, heldout: bool) -> int:
        return sum(self.is_heldout(i, seed) == heldout for i in range(self.num_prompts))


def _check_count(field: str, n: int) -> None:
    if not isinstance(n, int) or n < 0:
        raise TidalError(field, n, "is not a non-negative integer", "pass a count >= 0")


class Addition(Task):
    """`a+b=` with `digits`-digit operands; answer: the decimal sum reversed (e.g. 579 -> "975")."""

    def __init__(self, digits: int = 3, name: str = "addition"):
        self.name, self.digits = name, digits
        self.lo, self.hi = 10 ** (digits - 1), 10 ** digits - 1
        self.chars = "0123456789+="
        self._pattern = re.compile(rf"(\d{{{digits}}})\+(\d{{{digits}}})=")

    @cached_property
    def num_prompts(self) -> int:
        return (self.hi - self.lo + 1) ** 2

    def _operands(self, index: int) -> tuple[int, int]:
        width = self.hi - self.lo + 1
        if not 0 <= index < width * width:
            raise IndexError(f"prompt index {index} outside [0, {width * width})")
        return self.lo + index // width, self.lo + index % width

    def prompt_at(self, index: int) -> str:
        a, b = self._operands(index)
        return f"{a}+{b}="

    def problem_key(self, index: int) -> int:
        a, b = self._operands(index)
        return min(a, b) * (self.hi + 1) + max(a, b)

    def answer(self, prompt: str) -> str:
        m = self._pattern.fullmatch(prompt)
        if not m or m[1][0] == "0" or m[2][0] == "0":
            raise ValueError(f"{prompt!r} is not an {self.name} prompt like '{self.prompt_at(0)}'")
        return str(int(m[1]) + int(m[2]))[::-1]

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1


class Multiplication(Task):
    """`a*b=` with a `digits`-digit `a` and a one-digit `b` in 2..9 (x0 and x1 teach nothing); answer:
    the decimal product reversed (e.g. 347*8=2776 -> "6772")."""

    def __init__(self, digits: int = 3, name: str = "multiplication"):
        self.name, self.digits = name, digits
        self.lo, self.hi = 10 ** (digits - 1), 10 ** digits - 1
        self.chars = "0123456789*="
        self._pattern = re.compile(rf"(\d{{{digits}}})\*([2-9])=")

    @cached_property
    def num_prompts(self) -> int:
        return (self.hi - self.lo + 1) * 8

    def prompt_at(self, index: int) -> str:
        if not 0 <= index < self.num_prompts:
            raise IndexError(f"prompt index {index} outside [0, {self.num_prompts})")
        return f"{self.lo + index // 8}*{2 + index % 8}="

    def answer(self, prompt: str) -> str:
        m = self._pattern.fullmatch(prompt)
        if not m or m[1][0] == "0":
            raise ValueError(f"{prompt!r} is not a {self.name} prompt like '{self.prompt_at(0)}'")
        return str(int(m[1]) * int(m[2]))[::-1]

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1


class Sorting(Task):
    """`d1d2...dn:` with `length` digits (repeats allowed); answer: the same digits in ascending order."""

    def __init__(self, length: int = 6, name: str = "sorting"):
        self.name, self.length = name, length
        self.chars = "0123456789:"
        self._pattern = re.compile(rf"(\d{{{length}}}):")

    @cached_property
    def num_prompts(self) -> int:
        return 10 ** self.length

    def prompt_at(self, index: int) -> str:
        if not 0 <= index < self.num_prompts:
            raise IndexError(f"prompt index {index} outside [0, {self.num_prompts})")
        return f"{index:0{self.length}d}:"

    def answer(self, prompt: str) -> str:
        m = self._pattern.fullmatch(prompt)
        if not m:
            raise ValueError(f"{prompt!r} is not a {self.name} prompt like '{self.prompt_at(0)}'")
        return "".join(sorted(m[1]))

    @property
    def max_answer_chars(self) -> int:
        return self.length


class TaskRegistry:
    """Tasks by name. Names are unique: registering a second task under a taken name is an error."""

    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}

    def register(self, task: Task) -> Task:
        if task.name in self._tasks:
            raise TidalError("task.name", task.name, "is already registered",
                             "give the new task another name (registered: " + ", ".join(self.names()) + ")")
        self._tasks[task.name] = task
        return task

    def get(self, name: str) -> Task:
        task = self._tasks.get(name)
        if task is None:
            close = difflib.get_close_matches(str(name), self.names(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TidalError("data.task", name, f"is not a known task{hint}",
                             "use one of: " + ", ".join(self.names()))
        return task

    def names(self) -> list[str]:
        return sorted(self._tasks)


TASKS = TaskRegistry()
for _task in (Addition(), Multiplication(), Sorting()):
    TASKS.register(_task)


def get_task(name: str) -> Task:
    """A built-in or registered task by name (TidalError with a did-you-mean if unknown)."""
    return TASKS.get(name)


def register_task(task: Task) -> Task:
    """Add a task to the global registry (TidalError if the name is taken)."""
    return TASKS.register(task)


def task_names() -> list[str]:
    return TASKS.names()
