"""Where a run's prompts come from: a built-in task or data files, behind one interface.

    source.take(n, position) -> ([(prompt_ids, label)], position')   the RL stream, from a `DataPosition`
    source.heldout(n)        -> [EvalItem]                           held-out prompts for the accuracy

`TaskSource` serves a built-in task (`tidal/engine/rl_tasks.py`): its stream is random access by prompt index, so the
position is `DataPosition(0, prompts taken)`; labels carry the task's answer text and the exact verifier reads
them. `FileSource` serves `data.train_files` / `data.val_files` (`tidal/engine/datasets.py`): prompts rendered once
through the tokenizer (chat template included), those over `data.max_prompt_length` filtered and counted, the
order a seeded permutation per epoch (`PromptStream`). Rows are read bounded (`max_row_bytes`): a row too
large to hold a prompt within the limit is never parsed, and is filtered and counted like any over-long prompt.
With a builtin verifier, every kept prompt's ground truth is read the way the verifier reads it before the run:
one it can never pay (gsm8k: no number) is a `DataError` naming its file and row, or with
`data.unpayable_answers: warn` a logged warning, counted as `unpayable` in the summary. Either way the data a step
trains on is a pure function of (seed, position), and the position is in every checkpoint, so a resumed run reads
exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from tidal.engine.datasets import (
    DataError,
    DataPosition,
    DataSpec,
    FilterReport,
    PromptLabel,
    PromptRecord,
    PromptStream,
    file_of,
    filter_by_length,
    max_row_bytes,
    read_bounded,
    row_of,
)
from tidal.engine.evaluation import EvalItem
from tidal.engine.rl_tasks import Task

if TYPE_CHECKING:
    from tidal.engine.hf_tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: Why a verifier can never pay a ground truth (None: it can): `rewards.ground_truth_check` of a builtin.
AnswerCheck = Callable[[str], str | None]
_SHOWN_UNPAYABLE = 3  # rows a warning about unpayable answers names


class PromptSource(Protocol):
    def take(self, n: int, position: DataPosition) -> tuple[list[tuple[tuple[int, ...], PromptLabel]],
                                                            DataPosition]: ...
    def heldout(self, n: int) -> list[EvalItem]: ...
    def summary(self) -> dict: ...


@dataclass
class TaskSource:
    task: Task
    tok: Tokenizer
    seed: int

    def take(self, n, position):
        prompts = self.task.train_prompts(n, self.seed, position.offset)
        items = [(tuple(self.tok.prompt_ids(p)), PromptLabel(f"{self.task.name}:{position.offset + i}",
                                                             self.task.answer(p), self.task.name))
                 for i, p in enumerate(prompts)]
        return items, DataPosition(0, position.offset + n)

    def heldout(self, n):
        return [EvalItem(tuple(self.tok.prompt_ids(p)), PromptLabel(f"{self.task.name}:heldout:{i}",
                                                                    self.task.answer(p), self.task.name))
                for i, p in enumerate(self.task.heldout_prompts(n, self.seed))]

    def summary(self) -> dict:
        return {"source": f"task:{self.task.name}"}


def _label(record) -> PromptLabel:
    return PromptLabel(record.uid, record.answer, record.data_source, json.dumps(record.extra_info, sort_keys=True))


class FileSource:
    """Prompt files (see module doc). Everything is read and rendered here, before any worker starts."""

    def __init__(self, train: DataSpec, val: DataSpec, tok, max_prompt_length: int,
                 truncation: Literal["filter", "error"], seed: int,
                 shuffle: bool = True, answer_check: AnswerCheck | None = None,
                 unpayable: Literal["error", "warn"] = "error"):
        self.tok = tok
        self.answer_check, self.unpayable_mode = answer_check, unpayable
        self.train, self.train_report, self.train_unpayable = self._load(train, max_prompt_length, truncation)
        self.val, self.val_report, self.val_unpayable = self._load(val, max_prompt_length, truncation)
        self.stream = PromptStream(len(self.train), seed, shuffle)

    def _load(self, spec: DataSpec, max_len: int, truncation: Literal["filter", "error"]):
        records, oversized = read_bounded(spec, max_row_bytes(max_len))
        kept, report = filter_by_length(records, self.tok.prompt_ids, max_len, truncation, oversized=oversized)
        unpayable = self._check_answers(spec, [rec for rec, _ in kept])
        return [(ids, _label(rec)) for rec, ids in kept], report, unpayable

    def _check_answers(self, spec: DataSpec, records: list[PromptRecord]) -> int:
        """How many of `records` have a ground truth the verifier can never pay; with `unpayable: error`, the first
        is a DataError naming its file and row."""
        if self.answer_check is None:
            return 0
        check = self.answer_check
        bad = [(rec, why) for rec in records if (why := check(rec.answer)) is not None]
        if not bad:
            return 0
        rec, why = bad[0]
        if self.unpayable_mode == "error":
            raise DataError(spec.field, file_of(spec, rec.uid),
                            f"{row_of(spec, rec.uid)}: its answer {why}",
                            "fix or remove the row, pick a verifier that reads it (reward.function), or set "
                            "data.unpayable_answers: warn to train on it anyway (it never earns a reward)")
        shown = "; ".join(f"{row_of(spec, r.uid)}: {w}" for r, w in bad[:_SHOWN_UNPAYABLE])
        log.warning("%s: %d of %d prompts have an answer the verifier can never pay (data.unpayable_answers: "
                    "warn): %s%s", spec.field, len(bad), len(records), shown,
                    " ..." if len(bad) > _SHOWN_UNPAYABLE else "")
        return len(bad)

    def take(self, n, position):
        idx, after = self.stream.take(n, position)
        return [self.train[i] for i in idx], after

    def heldout(self, n):
        return [EvalItem(ids, label) for ids, label in self.val[:n]]

    def summary(self) -> dict:
        def rep(r: FilterReport, unpayable: int) -> dict:
            return {"kept": r.kept, "too_long": r.too_long, "longest_kept": r.longest_kept, "unpayable": unpayable}
        return {"source": "files", "train": rep(self.train_report, self.train_unpayable),
                "val": rep(self.val_report, self.val_unpayable)}
