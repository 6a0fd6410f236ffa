"""Reward functions (gsm8k, gsm8k_strict, math, exact), spec resolution, and RewardScorer's child process."""

from __future__ import annotations

import pickle
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from tidal.core.errors import TidalError
from tidal.engine.rewards import (
    BUILTIN,
    RewardError,
    RewardResult,
    RewardScorer,
    exact_score,
    gsm8k_score,
    gsm8k_strict_score,
    last_boxed,
    math_score,
    resolve_reward,
)

NATALIA = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
           "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("response, gold, expected", [
    ("The answer is $1,234.00", "1234", 1.0),
    ("#### 72", "72", 1.0),
    ("so 5 apples.\n#### 5", "5", 1.0),
    ("It is 3, no wait, 4.", "4", 1.0),
    ("It is 3, no wait, 4.", "3", 0.0),
    ("no answer at all", "4", 0.0),
    ("", "4", 0.0),
    ("#### 7", NATALIA, 0.0),
    ("She sold 72 clips.\n#### 72", NATALIA, 1.0),
    ("-3.5", "-3.50", 1.0),
    ("72.0", "72", 1.0),
    ("The total is 1234", "1,234", 1.0),
    ("#### $1,234", "1234", 1.0),
    ("#### 72\nThen 5 more steps were checked.", "72", 1.0),   # '####' wins over a later number
    ("#### 5 and later #### 6", "6", 1.0),                      # the last '####'
    ("from 10-7 we get", "7", 1.0),                             # '-' after a digit is not a sign
    ("x = -7", "-7", 1.0),
    ("1,2,3", "3", 1.0),                                        # not a thousands group
    ("12.5.", "12.5", 1.0),
])
def test_gsm8k(response: str, gold: str, expected: float) -> None:
    assert gsm8k_score("openai/gsm8k", response, gold) == expected


@pytest.mark.parametrize("response, gold, expected", [
    ("The answer is 72", "72", 0.0),
    ("#### 72", "72", 1.0),
    ("work...\n#### 1,234", "1234", 1.0),
    ("#### 71", NATALIA, 0.0),
    ("#### 72", NATALIA, 1.0),
])
def test_gsm8k_strict(response: str, gold: str, expected: float) -> None:
    assert gsm8k_strict_score("openai/gsm8k", response, gold) == expected


def test_gsm8k_gold_without_a_number_raises() -> None:
    with pytest.raises(ValueError, match="no number"):
        gsm8k_score("openai/gsm8k", "#### 3", "#### none")


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{\sqrt{\frac{1}{4}}}", r"\sqrt{\frac{1}{4}}"),
    (r"\boxed{1} then \boxed{2}", "2"),
    (r"\fbox{7}", "7"),
    (r"$\boxed 5$", "5"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\boxed{\frac{1}{2}", None),           # unclosed (truncated response)
    ("the answer is 1/2", None),
])
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize("response, gold, expected", [
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{0.5}", r"\frac12", 1.0),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
    (r"\boxed{\sqrt{\frac{1}{4}}}", r"\frac12", 1.0),
    (r"the answer is \frac12", r"\frac12", 0.0),
    (r"first \boxed{3}, finally \boxed{2}", "2", 1.0),
    (r"first \boxed{2}, finally \boxed{3}", "2", 0.0),
    (r"\boxed{2}", r"The answer is $\boxed{2}$.", 1.0),
    (r"\boxed{x^2 + 1}", "1+x^2", 1.0),
    (r"\boxed{}", "0", 0.0),
])
def test_math(response: str, gold: str, expected: float) -> None:
    assert math_score("math", response, gold) == expected


def test_math_in_a_worker_thread() -> None:
    # math_verify's default timeouts use signal.alarm, which raises outside the main thread.
    scores: list[float] = []
    worker = threading.Thread(target=lambda: scores.append(math_score("math", r"\boxed{0.5}", r"\frac12")))
    worker.start()
    worker.join()
    assert scores == [1.0]


@pytest.mark.parametrize("response, gold, expected", [
    ("abc", "abc", 1.0),
    ("  abc\n", "abc ", 1.0),
    ("abc", "abd", 0.0),
    ("", "", 1.0),
    ("ABC", "abc", 0.0),
])
def test_exact(response: str, gold: str, expected: float) -> None:
    assert exact_score("x", response, gold) == expected


# ------------------------------------------------------------------------------------ resolve_reward

@pytest.fixture(scope="module")
def reward_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway module on sys.path (the spawned child gets the parent's sys.path)."""
    name = "tidal_test_reward_module"
    folder = tmp_path_factory.mktemp("rewards")
    (folder / f"{name}.py").write_text(textwrap.dedent("""
        import os
        import time

        def ok(data_source, solution_str, ground_truth, extra_info=None):
            return 1 if solution_str == ground_truth else 0.25

        def weighted(data_source, solution_str, ground_truth, extra_info=None):
            return extra_info["weight"]

        def boom(data_source, solution_str, ground_truth, extra_info=None):
            return 1 / 0

        def hang_on(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "hang":
                time.sleep(3600)
            return 1.0

        def none(data_source, solution_str, ground_truth, extra_info=None):
            return None

        def nan(data_source, solution_str, ground_truth, extra_info=None):
            return float("nan")

        def text(data_source, solution_str, ground_truth, extra_info=None):
            return "1.0"

        def true(data_source, solution_str, ground_truth, extra_info=None):
            return True

        def exits(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "exit":
                os._exit(3)
            return 0.0

        NOT_CALLABLE = 3
    """))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_resolve_builtin(name: str) -> None:
    assert resolve_reward(name) is BUILTIN[name]


def test_resolve_custom(reward_module: str) -> None:
    assert resolve_reward(f"{reward_module}:ok")("d", "a", "a") == 1
    assert callable(resolve_reward("os.path:join"))


@pytest.mark.parametrize("spec, in_message", [
    ("gsm8kk", "did you mean 'gsm8k'?"),
    ("maths", "did you mean 'math'?"),
    ("nosuchmodule:f", "cannot be imported"),
    ("os:nosuchattr", "no attribute 'nosuchattr'"),
    ("os:sep", "not callable"),
    ("/tmp/reward.py:f", "file paths are not accepted"),
    ("os:", "not of the form"),
    ("", "unknown builtin"),
])
def test_resolve_rejects(spec: str, in_message: str) -> None:
    with pytest.raises(TidalError) as caught:
        resolve_reward(spec)
    assert caught.value.field == "reward.function" and caught.value.value == spec
    assert in_message in str(caught.value) and "Fix:" in str(caught.value)


def test_resolve_names_the_given_field() -> None:
    with pytest.raises(TidalError) as caught:
        resolve_reward("nope", field="tasks[0].reward")
    assert str(caught.value).startswith("tasks[0].reward: ")


# ------------------------------------------------------------------------------------- RewardScorer

def test_scorer_inline_builtin() -> None:
    with RewardScorer("gsm8k") as scorer:
        assert scorer.score("s0", "openai/gsm8k", "#### 72", NATALIA) == RewardResult(1.0)
        assert scorer.score("s1", "openai/gsm8k", "#### 7", NATALIA) == RewardResult(0.0)
        with pytest.raises(RewardError, match="sample 's2'.*ValueError"):
            scorer.score("s2", "openai/gsm8k", "#### 7", "no number here")
        assert scorer.num_timeouts == 0


def test_scorer_math_in_child() -> None:
    with RewardScorer("math", timeout_s=10) as scorer:
        assert scorer.score("m0", "math", r"so \boxed{0.5}", r"\frac12") == RewardResult(1.0)
        assert scorer.score("m1", "math", r"\boxed{3}", r"\frac12") == RewardResult(0.0)


def test_scorer_custom(reward_module: str) -> None:
    with RewardScorer(f"{reward_module}:weighted") as scorer:
        result = scorer.score("c0", "d", "a", "a", {"weight": 0.5})
        assert result == RewardResult(0.5) and type(result.score) is float


@pytest.mark.parametrize("function, score", [("ok", 1.0), ("true", 1.0)])
def test_scorer_returns_floats(reward_module: str, function: str, score: float) -> None:
    with RewardScorer(f"{reward_module}:{function}") as scorer:
        result = scorer.score("c0", "d", "a", "a")
        assert result.score == score and type(result.score) is float


def test_scorer_custom_raises(reward_module: str) -> None:
    spec = f"{reward_module}:boom"
    with RewardScorer(spec) as scorer:
        with pytest.raises(RewardError) as caught:
            scorer.score("sample-17", "d", "a", "a")
        assert caught.value.field == "reward.function" and caught.value.value == spec
        assert "sample 'sample-17'" in caught.value.problem
        assert "ZeroDivisionError: division by zero" in caught.value.problem
        assert "choose a builtin: exact, gsm8k, gsm8k_strict, math" in caught.value.fix
        with pytest.raises(RewardError):  # the child survives a raising call
            scorer.score("sample-18", "d", "a", "a")


@pytest.mark.parametrize("function, shown", [("none", "None"), ("nan", "nan"), ("text", "'1.0'")])
def test_scorer_rejects_non_scores(reward_module: str, function: str, shown: str) -> None:
    with RewardScorer(f"{reward_module}:{function}") as scorer, \
            pytest.raises(RewardError, match=f"sample 'x1'.*returned {shown}, not a finite real number"):
        scorer.score("x1", "d", "a", "a")


def test_scorer_timeout_kills_and_restarts(reward_module: str) -> None:
    with RewardScorer(f"{reward_module}:hang_on", timeout_s=1) as scorer:
        assert scorer.score("t0", "d", "fast", "a") == RewardResult(1.0)
        started = time.monotonic()
        assert scorer.score("t1", "d", "hang", "a") == RewardResult(0.0, timed_out=True)
        assert 1.0 <= time.monotonic() - started < 5.0
        assert scorer.num_timeouts == 1
        assert scorer.score("t2", "d", "fast", "a") == RewardResult(1.0)  # a fresh child
        assert scorer.num_timeouts == 1


def test_scorer_child_that_exits(reward_module: str) -> None:
    with RewardScorer(f"{reward_module}:exits") as scorer:
        with pytest.raises(RewardError, match="sample 'e0'.*exited during the call"):
            scorer.score("e0", "d", "exit", "a")
        assert scorer.score("e1", "d", "stay", "a") == RewardResult(0.0)  # a fresh child


def test_scorer_close_is_idempotent(reward_module: str) -> None:
    scorer = RewardScorer(f"{reward_module}:ok")
    assert scorer.score("c0", "d", "a", "b") == RewardResult(0.25)
    scorer.close()
    scorer.close()
    assert scorer.score("c1", "d", "a", "a") == RewardResult(1.0)  # a closed scorer restarts on use
    scorer.close()


@pytest.mark.parametrize("spec", ["gsm8kk", "nosuchmodule:f"])
def test_scorer_rejects_bad_spec_at_construction(spec: str) -> None:
    with pytest.raises(TidalError, match="^reward.function: "):
        RewardScorer(spec)


@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan"), True])
def test_scorer_rejects_bad_timeout(timeout_s: float) -> None:
    with pytest.raises(TidalError, match="^reward.timeout_s: "):
        RewardScorer("exact", timeout_s=timeout_s)


def test_reward_error_pickles() -> None:
    err = RewardError("reward.function", "pkg.mod:f", "sample 's1': reward function raised KeyError: 'x'",
                      "fix the reward function")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RewardError and isinstance(back, TidalError)
    assert (back.field, back.value, back.problem, back.fix) == (err.field, err.value, err.problem, err.fix)
    assert str(back) == str(err)
