"""Every error Tidal raises survives pickling intact: a user error raised on a worker reaches the driver as
itself (type, field, value, problem, fix), and the runtime's own errors keep the device they name."""

import pickle

import pytest

from tidal.core.errors import TidalError
from tidal.workers.errors import WorkerCallError, WorkerDied, WorkerError, WorkerTimeout


def _subclasses(cls):
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def _import_everything():
    """Every module that defines an error, so `__subclasses__` sees them all."""
    import tidal.core.config
    import tidal.engine.backends.megatron_ckpt
    import tidal.engine.checkpoint
    import tidal.engine.datasets
    import tidal.engine.rewards  # noqa: F401


_import_everything()
USER_ERRORS = sorted({TidalError, *_subclasses(TidalError)}, key=lambda c: c.__qualname__)


@pytest.mark.parametrize("cls", USER_ERRORS, ids=lambda c: c.__qualname__)
def test_every_user_error_round_trips_through_pickle(cls):
    err = cls("actor.lr", float("inf"), "must be finite", "give a positive number")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert (back.field, back.value, back.problem, back.fix) == (err.field, err.value, err.problem, err.fix)
    assert str(back) == str(err) and back.exit_code == 2


def test_a_user_error_names_the_device_that_raised_it():
    from tidal.core.errors import ConfigError
    err = ConfigError("data.train_files", "x.jsonl", "is not readable", "check the path").on_device(5, 2)
    assert type(err) is ConfigError and err.field == "data.train_files"
    assert "[raised on device 5, rank 2]" in str(err)


@pytest.mark.parametrize("err", [WorkerDied(3, "process gone"), WorkerTimeout((1, 2), "m:f", 4.0),
                                 WorkerCallError(5, "m:f", "Traceback...\nValueError: boom")],
                         ids=lambda e: type(e).__name__)
def test_runtime_errors_round_trip_through_pickle(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    assert isinstance(back, WorkerError)

