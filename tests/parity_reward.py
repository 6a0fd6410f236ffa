"""A reward function for pipeline tests whose models are random: 1 for a response of even length in characters,
else 0, so about half the samples of every group are rewarded and every step trains (a random model never earns
the task's own reward, and with every reward alike GRPO's advantages, and so its updates, are zero). verl's
signature, loaded as `reward.function=tests.parity_reward:score` by the workers (the repository root is on their
path: Ray starts them in the driver's working directory)."""


def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    return float(len(solution_str) % 2 == 0)


def fails(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """verl's signature, and every call raises: a user's reward with a bug, met only when a sample is scored."""
    raise ZeroDivisionError(f"the user's reward divided by zero on {len(solution_str)} characters")
