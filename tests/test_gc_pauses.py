"""GcPauses: the collector's pauses in this process, timed through gc.callbacks."""

import gc

from tidal.workers.gc_pauses import GcPauses


def test_collections_are_timed_and_taken_once():
    pauses = GcPauses.install()
    assert GcPauses.install() is pauses   # one timer per process
    pauses.take()
    junk = []
    for _ in range(2000):   # cycles the collector has to find
        a = []
        a.append(a)
        junk.append(a)
    del junk
    gc.collect()
    seconds, longest, n = pauses.take()
    assert n >= 1 and 0 < longest <= seconds
    assert pauses.take() == (0.0, 0.0, 0)


def test_freeze_leaves_later_collections_less_to_scan():
    keep = [[k] for k in range(50_000)]   # long-lived containers, as a model's and an engine's objects are
    gc.collect()
    before = len(gc.get_objects(generation=2))
    GcPauses.freeze()
    try:
        assert gc.get_freeze_count() >= len(keep)
        assert len(gc.get_objects(generation=2)) < before - len(keep) // 2
    finally:
        gc.unfreeze()
