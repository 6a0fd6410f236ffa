"""What the actuator believes about rollout instances after it migrates work between them (no cluster)."""

import torch

from tidal.engine.generation.requests import Request, RequestState
from tidal.pipeline.cluster import move_reported
from tidal.workers.messages import MigrationPackage, RolloutReport


def _moved(tokens_per_request, open_groups, queued=0):
    """The summary of an export package as `rollout_export` makes it (engine states of the moving requests, open
    groups, queued), as the target reports it to the driver."""
    states = tuple(RequestState(Request(f"m/g0/i{k}", (1, 2, 3)), [5] * n, [0.0] * n,
                                torch.zeros(8, dtype=torch.uint8), 0 if n else None)
                   for k, n in enumerate(tokens_per_request))
    return MigrationPackage((None,) * queued, dict.fromkeys(range(open_groups)), states).summary()


def test_a_move_carries_its_sequences_and_their_progress():
    """Instance 2 gives one open group (3 sequences left, 10 + 4 + 0 tokens generated) and one queued group to
    instance 3. The reports move exactly that much: nothing else on the target reads as unstarted."""
    reports = {2: RolloutReport(running=5, waiting=2, progress=40, groups_in_progress=3, token_rate=9.0),
               3: RolloutReport(running=1, waiting=0, progress=30, groups_in_progress=1, token_rate=7.0)}
    move_reported(reports, 2, 3, _moved([10, 4, 0], open_groups=1, queued=1))
    assert reports[2] == RolloutReport(running=4, waiting=0, progress=26, groups_in_progress=2, token_rate=9.0)
    assert reports[3] == RolloutReport(running=4, waiting=0, progress=44, groups_in_progress=2, token_rate=7.0)


def test_without_a_report_for_either_side_both_fall_back_to_given_groups():
    reports = {2: RolloutReport(running=5, waiting=0, progress=40, groups_in_progress=3)}
    move_reported(reports, 2, 3, _moved([10], open_groups=1))
    assert reports == {}
