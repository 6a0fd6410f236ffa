"""Where a run's prompts come from: a built-in task or data files, behind one interface.

    source.take(n, position) -> ([(prompt_ids, label)], position')   the RL stream, from a `DataPosition`
    source.heldout(n)        -> [EvalItem]                           held-out prompts for the accuracy

`TaskSource` serves a built-in task (`tidal/engine/rl_tasks.py`): its stream is random access by prompt index, so the
position is `DataPosition(0, prompts taken)`; labels carry the task's answer text and the exact verifier reads
them. `FileSource` serves `data.train_files` / `data.val_files` (`tidal/engine/datasets.py`): prompts rendered once
through the tokenizer (chat template included), those over `data.max_prompt_length` filtered and counted, the
order a seeded permutation per epoch (`PromptStream`). Either way the data a step trains on is a pure function of
(seed, position), and the position is in every checkpoint, so a resumed run reads exactly the prompts an
uninterrupted one would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from tidal.engine.datasets import (
    DataPosition,
    DataSpec,
    FilterReport,
    PromptLabel,
    PromptStream,
    filter_by_length,
    read_records,
)
from tidal.engine.evaluation import EvalItem
from tidal.engine.rl_tasks import Task

if TYPE_CHECKING:
    from tidal.engine.hf_tokenizer import Tokenizer


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
                 shuffle: bool = True):
        self.tok = tok
        self.train, self.train_report = self._load(train, max_prompt_length, truncation)
        self.val, self.val_report = self._load(val, max_prompt_length, truncation)
        self.stream = PromptStream(len(self.train), seed, shuffle)

    def _load(self, spec: DataSpec, max_len: int, truncation: Literal["filter", "error"]):
        kept, report = filter_by_length(read_records(spec), self.tok.prompt_ids, max_len, truncation)
        return [(ids, _label(rec)) for rec, ids in kept], report

    def take(self, n, position):
        idx, after = self.stream.take(n, position)
        return [self.train[i] for i in idx], after

    def heldout(self, n):
        return [EvalItem(ids, label) for ids, label in self.val[:n]]

    def summary(self) -> dict:
        def rep(r: FilterReport) -> dict:
            return {"kept": r.kept, "too_long": r.too_long, "longest_kept": r.longest_kept}
        return {"source": "files", "train": rep(self.train_report), "val": rep(self.val_report)}
