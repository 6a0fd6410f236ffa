"""The asynchronous run's store of later steps' work (tidal/pipeline/ahead.py), without workers: which steps may be
dealt, prompts drawn in step order, results and losses booked per step."""

import torch

from tidal.engine.datasets import DataPosition
from tidal.engine.prompt_source import PromptLabel
from tidal.engine.records import RolloutGroup
from tidal.pipeline.ahead import Ahead

B = 3   # prompts per step


def _draw(pos: DataPosition):
    """Prompts numbered by their place in the stream: step t's are (B t, B t + 1, B t + 2)."""
    return ([((pos.offset + i,), PromptLabel(f"p{pos.offset + i}", "0", "task")) for i in range(B)],
            DataPosition(0, pos.offset + B))


def _record(step: int, gid: int) -> RolloutGroup:
    return RolloutGroup(gid, step, (1,), ((2,),), (torch.zeros(1),), (1.0,), step - 1, ("eos",))


def test_later_steps_open_in_order_within_the_staleness_bound_and_the_run():
    a = Ahead(max_staleness=2, last_step=4, draw=_draw)
    steps = list(a.dealable(1, engines_version=1, next_pos=DataPosition(0, 2 * B)))
    assert [s.step for s in steps] == [2, 3]   # up to version + k
    assert [g.prompt_ids for g in steps[0].groups.values()] == [(6,), (7,), (8,)]
    assert [g.prompt_ids for g in steps[1].groups.values()] == [(9,), (10,), (11,)]
    assert all(g.step == 3 for g in steps[1].queue) and steps[1].next_pos == DataPosition(0, 4 * B)
    # the engines still hold version 1 at step 2: step 3 may go on, step 4 not yet; a step opens once
    assert [s.step for s in a.dealable(2, engines_version=1, next_pos=steps[0].next_pos)] == [3]
    assert [s.step for s in a.dealable(3, engines_version=3, next_pos=steps[1].next_pos)] == [4]
    assert list(a.dealable(4, engines_version=4, next_pos=DataPosition(0, 5 * B))) == []   # the run's last step


def test_results_and_a_lost_instance_are_booked_per_step():
    a = Ahead(max_staleness=1, last_step=9, draw=_draw)
    (s1,) = a.dealable(0, engines_version=0, next_pos=DataPosition(0, B))
    g0, _, g2 = s1.queue.popleft(), s1.queue.popleft(), s1.queue.popleft()
    s1.dealt(7, 2)   # groups 0 and 1 to instance 7, group 2 to instance 8
    s1.dealt(8, 1)
    assert a.given_to(7) == 2 and a.given_to(8) == 1
    a.arrived(7, [_record(1, g0.group_id)])
    assert a.given_to(7) == 1 and set(s1.generated) == {0}
    # instance 7 is lost holding group 1; instance 8 still holds group 2
    assert a.lost(7, held=[(1, g2.group_id)]) == {1: [1]}
    assert [g.group_id for g in s1.queue] == [1] and a.given_to(7) == 0
    popped = a.pop(1)
    assert popped is s1 and a.pop(1) is None and not a.steps
    next(a.dealable(0, engines_version=0, next_pos=DataPosition(0, B)))
    a.clear()
    assert not a.steps
