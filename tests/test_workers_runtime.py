"""The worker runtime on a real embedded Ray: a gloo world, state between calls, dead workers, compute shares.

One Ray instance serves the whole module (ray.init costs ~5 s and ~1 GB); `ray.shutdown()` runs whatever
happens. Groups are small (2-4 CPU workers with one thread each).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from tidal.workers.compute_share import ComputeShare, _cgroup_parent, cores_for_share
from tidal.workers.errors import WorkerCallError, WorkerDied
from tidal.workers.probes import seeded_tensor
from tidal.workers.ray_env import connect, disconnect, ray_listeners
from tidal.workers.runtime import WorkerGroup

P = "tidal.workers.probes:"
DEVICES = [2, 5, 0, 7]  # ids on purpose not equal to ranks: rank = position in this list


@pytest.fixture(scope="module")
def ray_session():
    session = connect()
    try:
        yield session
    finally:
        disconnect(session)
        import ray

        ray.shutdown()  # also when the session was borrowed from an earlier module: leave nothing behind


@pytest.fixture(scope="module")
def group4(ray_session):
    group = WorkerGroup.start(DEVICES, "cpu")
    try:
        yield group
    finally:
        group.shutdown()


# ----------------------------------------------------------------------------------------- the world
@pytest.mark.timeout(180)
def test_allreduce_equals_single_process_reference(group4):
    out = group4.call_all(P + "allreduce_seeded", seed=11, numel=1000, timeout=60)
    reference = sum(seeded_tensor(11 + d, 1000) for d in DEVICES)
    assert list(out) == DEVICES
    for d in DEVICES:
        assert torch.equal(torch.tensor(out[d], dtype=torch.float64), reference), d


@pytest.mark.timeout(120)
def test_ranks_follow_device_order_and_backend_is_gloo(group4):
    info = group4.call_all(P + "world_info", timeout=30)
    assert [info[d]["rank"] for d in DEVICES] == [0, 1, 2, 3]
    assert {info[d]["device_id"] for d in DEVICES} == set(DEVICES)
    assert all(i["world_size"] == 4 and i["backend"] == "gloo" for i in info.values())
    assert len({i["pid"] for i in info.values()}) == 4  # one process per device
    assert group4.call_all(P + "allreduce_rank_weighted", base=1.5, timeout=30) == dict.fromkeys(DEVICES, 15.0)


@pytest.mark.timeout(120)
def test_state_persists_between_calls_per_worker(group4):
    for d in DEVICES:
        group4.call(d, P + "put_state", key="shard", value=f"shard-of-{d}", timeout=30)
    for _ in range(3):
        group4.call_all(P + "add_to_state", key="steps", delta=1.0, timeout=30)
    group4.call(5, P + "add_to_state", key="steps", delta=10.0, timeout=30)
    assert group4.call_all(P + "get_state", key="shard", timeout=30) == {d: f"shard-of-{d}" for d in DEVICES}
    assert group4.call_all(P + "get_state", key="steps", timeout=30) == {2: 3.0, 5: 13.0, 0: 3.0, 7: 3.0}


@pytest.mark.timeout(120)
def test_async_submit_gather_and_subset(group4):
    handles = group4.submit_all(P + "sleep", seconds=0.2, device_ids=[7, 2])
    assert group4.gather(handles, timeout=30) == [7, 2]
    # a collective on a subset would hang the others; a per-device call on a subset is fine
    h = group4.submit(0, P + "add_to_state", key="x", delta=2.0)
    assert group4.gather([h], timeout=30) == [2.0]


@pytest.mark.timeout(120)
def test_function_errors_name_the_device(group4):
    with pytest.raises(WorkerCallError, match="failed on device 5") as e:
        group4.call(5, P + "fail", message="boom", timeout=30)
    assert "boom" in e.value.remote_traceback
    with pytest.raises(WorkerCallError, match="has no attribute 'nope'"):
        group4.call(0, P + "nope", timeout=30)
    with pytest.raises(KeyError, match="device 3 has no worker"):
        group4.call(3, P + "sleep", seconds=0)
    assert group4.call(5, P + "sleep", seconds=0, timeout=30) == 5  # the worker survived its error


@pytest.mark.timeout(120)
def test_a_user_error_raised_on_a_worker_reaches_the_driver_as_itself(group4):
    """A `TidalError` on a worker arrives as the same type with its fields (so the CLI exits 2 with its message),
    naming the device and rank that raised it; the worker lives on."""
    from tidal.core.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        group4.call(5, P + "fail_with_config_error", field="actor.lr", timeout=30)
    assert e.value.field == "actor.lr" and e.value.fix == "give another value"
    assert "device 5, rank 1" in str(e.value), str(e.value)
    assert group4.call(5, P + "sleep", seconds=0, timeout=30) == 5


@pytest.mark.timeout(120)
def test_health_answers_while_a_call_is_running(group4):
    handles = group4.submit_all(P + "sleep", seconds=2.0)
    time.sleep(0.5)
    health = group4.health(timeout=10)
    assert all(s.state == "alive" for s in health.values())
    assert {s.report.busy_fn for s in health.values()} == {P + "sleep"}
    group4.gather(handles, timeout=30)


# ------------------------------------------------------------------------------------ dead workers
@pytest.mark.timeout(120)
def test_interrupt_ends_a_polling_call_early_and_only_on_the_named_devices(group4):
    hs = group4.submit_all(P + "wait_for_interrupt", device_ids=(0, 5), name="slice", seconds=3.0, seq=0)
    time.sleep(0.3)
    group4.interrupt({0: 0}, "slice")
    first, second = group4.gather(hs, timeout=30)
    assert first["interrupted"] and first["after_s"] < 2.5
    assert not second["interrupted"] and second["after_s"] >= 3.0
    # an interrupt that finds no call polling it ends the call of that number when it comes, and no later one
    group4.interrupt({7: 0}, "slice")
    time.sleep(0.3)
    assert group4.call(7, P + "wait_for_interrupt", name="slice", seconds=3.0, seq=0, timeout=30)["interrupted"]
    assert not group4.call(7, P + "wait_for_interrupt", name="slice", seconds=0.2, seq=1, timeout=30)["interrupted"]


@pytest.mark.timeout(120)
def test_a_numbered_interrupt_ends_every_call_queued_up_to_it_and_no_later_one(group4):
    """The driver keeps two rollout slices queued per instance: one interrupt must end both (the running one and
    the one behind it), and must not touch a slice submitted after it."""
    hs = [group4.submit(5, P + "wait_for_interrupt", name="slice", seconds=3.0, seq=k) for k in (0, 1)]
    time.sleep(0.3)
    group4.interrupt({5: 1}, "slice")
    later = group4.submit(5, P + "wait_for_interrupt", name="slice", seconds=0.3, seq=2)
    a, b, c = group4.gather([*hs, later], timeout=30)
    assert a["interrupted"] and b["interrupted"] and b["after_s"] < 0.5, (a, b)
    assert not c["interrupted"] and c["after_s"] >= 0.3


@pytest.mark.timeout(180)
def test_killed_worker_is_reported_by_device_id_within_bounded_time(ray_session):
    group = WorkerGroup.start([4, 1], "cpu")
    try:
        # Both ranks enter a collective-free long call; device 1's process is then killed.
        handles = group.submit_all(P + "sleep", seconds=60)
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(group.pid(1), signal.SIGKILL)
        with pytest.raises(WorkerDied) as e:
            group.gather(handles, timeout=120)
        elapsed = time.monotonic() - t0
        assert e.value.device_id == 1
        assert elapsed < 20, f"death reported after {elapsed:.1f}s"
        # From then on the device is known dead: no round trip, no hang.
        with pytest.raises(WorkerDied, match="device 1"):
            group.call(1, P + "sleep", seconds=0, timeout=5)
        assert group.health(timeout=10)[1].state == "dead"
        assert group.health(timeout=10)[4].state == "alive"
    finally:
        group.shutdown()


@pytest.mark.timeout(180)
def test_worker_killed_inside_a_collective_is_reported(ray_session):
    group = WorkerGroup.start([0, 1], "cpu", world_timeout_s=60)
    try:
        victim = group.pid(0)
        h_alive = group.submit(1, P + "allreduce_sum", value=1.0)  # waits for rank 0 forever
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied) as e:
            group.gather([h_alive], timeout=60)
        # the survivor's collective is stuck or failed, but the dead device is the one named, promptly
        assert time.monotonic() - t0 < 20
        assert e.value.device_id == 0
        with pytest.raises(WorkerDied):
            group.check()
    finally:
        group.shutdown()


# ---------------------------------------------------------------------------------- network surface
@pytest.mark.timeout(120)
def test_ray_and_world_listen_on_loopback_only(ray_session, group4):
    if not ray_session.owned:
        pytest.skip("Ray was started outside this module; its bind settings are not ours")
    listeners = ray_listeners()
    assert any(x.process == "gcs_server" for x in listeners)
    exposed = [x for x in listeners if not x.loopback]
    assert exposed == [], exposed
    mode = stat.S_IMODE(os.stat(ray_session.token_path).st_mode)
    assert mode == 0o600, oct(mode)


def test_bad_device_lists_are_refused_before_starting_anything():
    with pytest.raises(ValueError, match="repeat an id"):
        WorkerGroup.start([0, 1, 1])
    with pytest.raises(ValueError, match="empty"):
        WorkerGroup.start([])
    with pytest.raises(ValueError, match="CPU virtual devices only"):
        WorkerGroup.start([0], "cuda", compute_share=0.5)


# ------------------------------------------------------------------------------------ compute share
BURN = "import sys,time\nt=time.monotonic();c=time.process_time()\nwhile time.monotonic()-t<{s}: pass\n" \
       "print((time.process_time()-c)/(time.monotonic()-t))"


def _burn(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BURN.format(s=seconds)], stdout=subprocess.PIPE, text=True)


def _assert_quarter_core(rate: float, control: float, what: str) -> None:
    """The cap's property, robust to a machine shared with other work (no speed claim).

    Upper bound: never much above 0.25 core-s/s. Lower bound: about the cap, unless the machine had less
    than that to give; an uncapped control running at the same time measures what it had to give.
    """
    assert rate <= 0.40, f"{what}: {rate:.3f} core-s/s under a 0.25-core cap (control got {control:.3f})"
    # 0.4, not closer to 1: the capped and the control process do not see the same contention at the same
    # instant (seen in CI under load: 0.133 core-s/s with a control at 0.558)
    assert rate >= 0.4 * min(0.25, control), f"{what}: {rate:.3f} core-s/s, control {control:.3f}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["duty", "cgroup1", "cgroup2"])
def test_busy_loop_under_quarter_core_gets_about_a_quarter(backend):
    if backend != "duty" and _cgroup_parent(backend) is None:
        pytest.skip(f"no writable {backend} cpu controller here")
    capped, control = _burn(2.5), _burn(2.5)
    cap = ComputeShare.apply(capped.pid, 0.25, backend=backend)
    try:
        rate = float(capped.communicate(timeout=60)[0])
    finally:
        cap.release()
    assert cap.backend == backend
    _assert_quarter_core(rate, float(control.communicate(timeout=60)[0]), backend)


def _fake_proc(root, pid: int, schedstats: list[str], utime: int, stime: int) -> None:
    task = root / str(pid) / "task"
    for k, line in enumerate(schedstats):
        (task / str(pid + k)).mkdir(parents=True)
        (task / str(pid + k) / "schedstat").write_text(line + "\n")
    fields = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30   # state is field 3, utime 14, stime 15
    (root / str(pid) / "stat").write_text(f"{pid} (python) " + " ".join(fields) + "\n")


def test_cpu_time_reads_schedstat_and_falls_back_to_stat_where_it_reads_zero(tmp_path, monkeypatch):
    from tidal.workers import compute_share
    monkeypatch.setattr(compute_share, "_PROC", tmp_path)
    tck = os.sysconf("SC_CLK_TCK")
    _fake_proc(tmp_path, 100, ["1500000000 0 1", "500000000 0 1"], utime=7 * tck, stime=1 * tck)
    assert compute_share.cpu_time_s(100) == 2.0             # nanoseconds of every live thread
    # gVisor (a sandbox GPU machines may run in) has the files but counts nothing in them: a duty cycle reading 0
    # would never stop its target, so the coarser /proc/PID/stat counters are used instead
    _fake_proc(tmp_path, 200, ["0 0 1", "0 0 1"], utime=7 * tck, stime=1 * tck)
    assert compute_share.cpu_time_s(200) == 8.0
    with pytest.raises(ProcessLookupError):
        compute_share.cpu_time_s(300)


def test_compute_share_input_errors():
    with pytest.raises(ValueError, match="must be > 0"):
        ComputeShare.apply(os.getpid(), 0)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        cores_for_share(1.5)
    with pytest.raises(ProcessLookupError):
        ComputeShare.apply(2**22 + 12345, 0.5)


@pytest.mark.timeout(180)
def test_ray_workers_with_compute_share_are_capped(ray_session):
    share = 0.25 / (os.cpu_count() or 1)  # 0.25 core per device, whatever the machine
    group = WorkerGroup.start([0, 1], "cpu", compute_share=share, share_period_s=0.02)
    try:
        assert {d: c.period_s for d, c in group._caps.items()} == {0: 0.02, 1: 0.02}   # not the 50 ms default
        _assert_group_capped_at_quarter_core(group)
    finally:
        group.shutdown()


def _assert_group_capped_at_quarter_core(group) -> None:
    """Devices 0 and 1 each burn ~0.25 core next to an uncapped control, and still form a working world."""
    control = _burn(2.0)
    rates = group.call_all(P + "busy_cpu_rate", seconds=2.0, timeout=60)
    control_rate = float(control.communicate(timeout=60)[0])
    for d, rate in rates.items():
        _assert_quarter_core(rate, control_rate, f"device {d}")
    assert group.call_all(P + "allreduce_sum", value=1.0, timeout=30) == {0: 2.0, 1: 2.0}


@pytest.mark.timeout(180)
def test_ray_workers_pinned_to_cores_with_the_share_of_those_cores(ray_session):
    """cpu_cores pins every thread of every worker (threads made later inherit) and the share is of those cores."""
    last = (os.cpu_count() or 1) - 1
    share = 0.25  # of one core -> 0.25 core per device
    group = WorkerGroup.start([0, 1], "cpu", compute_share=share, cpu_cores=[last])
    try:
        for d, threads in group.call_all(P + "thread_affinities", timeout=30).items():
            assert threads and all(t == [last] for t in threads), (d, threads)
        _assert_group_capped_at_quarter_core(group)
    finally:
        group.shutdown()


def test_cpu_cores_input_errors(tmp_path):
    from tidal.core.config import build_config
    from tidal.core.errors import ConfigError
    from tidal.workers.compute_share import pin_process

    with pytest.raises(ValueError, match="this machine has cores"):
        WorkerGroup.start([0], "cpu", cpu_cores=[os.cpu_count() or 1])
    with pytest.raises(ValueError, match="CPU virtual devices only"):
        WorkerGroup.start([0], "cuda", cpu_cores=[0])
    with pytest.raises(ValueError, match="do not exist"):
        pin_process(os.getpid(), {(os.cpu_count() or 1) + 3})
    with pytest.raises(ProcessLookupError):
        pin_process(2**22 + 12345, {0})
    with pytest.raises(ConfigError, match="cluster.cpu_device_cores"):
        build_config({"cluster": {"cpu_device_cores": "2-1"}})
    assert build_config({"cluster": {"cpu_device_cores": "0-1"}}).cluster.cpu_device_core_ids == (0, 1)
