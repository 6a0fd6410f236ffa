"""Which queued groups the idle inference devices score now (`tidal.pipeline.driver.scoring_calls`)."""

import pytest

from tidal.pipeline.driver import scoring_calls

MB1 = set(range(8, 16))   # the actor's next mini-batch: groups 8-15


@pytest.mark.parametrize("why, queue, idle, busy, reserve, takes", [
    ("nothing pending: up to 2 groups a call, the queue split over the idle devices",
     [8, 9, 10, 11, 20], 2, 0, False, [2, 2]),
    ("a short queue: one group a call", [8, 9], 2, 0, False, [1, 1]),
    ("an empty queue: no call", [], 2, 0, False, []),
    ("mini-batch still generating, its group leads the queue: it goes alone (not with a later one), and the "
     "other device stays free for the rest of the mini-batch", [8, 20, 21], 2, 0, True, [1]),
    ("mini-batch still generating, only later groups queued: one device takes one, the other stays free",
     [20, 21, 22, 23], 2, 0, True, [1]),
    ("same with a device already busy: the idle one stays free for the mini-batch", [20, 21], 1, 1, True, []),
    ("an urgent group arrives while one device scores a later group: the free device takes it",
     [9, 20], 1, 1, True, [1]),
    ("two urgent groups lead: one call of both", [9, 10, 20, 21], 1, 1, True, [2]),
])
def test_scoring_calls(why, queue, idle, busy, reserve, takes):
    assert scoring_calls(queue, idle, busy, MB1, reserve) == takes, why
