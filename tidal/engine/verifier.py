"""The reward of one response: a prompt's label (its ground truth) and the response text in, a float out.

    Verifier(None)        built-in tasks: `rl_tasks.verify(answer, text)` (exact, up to the first `<eos>`)
    Verifier("gsm8k"...)  `reward.function`, through `rewards.RewardScorer` (its timeout; math and custom
                          functions in a child process)

Each rollout worker holds one, built from the run spec. A reward function that raises stops the run with a
`RewardError` naming the sample id and the function; one that times out scores 0 and is counted
(`num_timeouts`, reported per rollout call as `reward_timeouts`).
"""

from __future__ import annotations

import json

from tidal.engine.rewards import RewardScorer
from tidal.engine.rl_tasks import verify


class Verifier:
    def __init__(self, function: str | None, timeout_s: float = 10.0):
        self.function = function
        self._scorer = RewardScorer(function, timeout_s) if function is not None else None

    @property
    def num_timeouts(self) -> int:
        return self._scorer.num_timeouts if self._scorer is not None else 0

    def score(self, label, text: str) -> float:
        """`label`: a `PromptLabel` (uid, answer, data_source, extra_info JSON)."""
        if self._scorer is None:
            return verify(label.answer, text)
        return self._scorer.score(label.uid, label.data_source, text, label.answer,
                                  json.loads(label.extra_info)).score

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()
