"""Where the step time goes (lumen_jax/metrics/timing.py), on a fake clock: the data wait, each step's
device time from dispatch and readiness, the loop's waits, and the per-step figures of an interval."""

import threading

import pytest

from lumen_jax.metrics.timing import LoopTimes, StepClock, TimedData, Totals


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Device:
    """A step's metrics whose `block_until_ready` returns when the test says the step is done."""

    def __init__(self):
        self.done = threading.Event()

    def block_until_ready(self):
        self.done.wait(timeout=10)
        return self


def test_timed_data_counts_the_wait_and_passes_the_rest_through(monkeypatch):
    from lumen_jax.metrics import timing
    fake = FakeTime()
    monkeypatch.setattr(timing.time, "perf_counter", fake)

    class Source:
        state = 0

        def __next__(self):
            fake.t += 0.25  # the source takes a quarter of a second per batch
            self.state += 1
            return {"x": self.state}

        def get_state(self):
            return {"position": self.state}

    data = TimedData(Source())
    assert [next(data)["x"] for _ in range(3)] == [1, 2, 3]
    assert data.wait_s == pytest.approx(0.75)
    assert data.get_state() == {"position": 3}


def test_step_clock_device_time_runs_from_when_the_step_could_start_to_ready():
    """Step 1 dispatched at 0, ready at 1; step 2 dispatched at 0.5 (queued behind step 1), ready at 3;
    step 3 dispatched at 5 (the device waited for the host from 3 to 5), ready at 6: the device worked
    1 + 2 + 1 = 4 s, and the steps ended 2 s and 3 s after the one before."""
    fake = FakeTime()
    steps = [Device() for _ in range(3)]
    calls = iter(steps)
    clock = StepClock(lambda state, batch: (state, next(calls)), first_step=1, now=fake)
    try:
        for step, (dispatch, ready) in enumerate([(0.0, 1.0), (0.5, 3.0), (5.0, 6.0)], start=1):
            fake.t = dispatch
            clock("state", "batch")
            fake.t = ready
            steps[step - 1].done.set()
            clock.wait(step)  # returns once the watcher has seen the step ready (no time passes)
        assert clock.device_s == pytest.approx(4.0)
        assert (clock.between(2), clock.between(3)) == (pytest.approx(2.0), pytest.approx(3.0))
        assert clock.between(1) is None  # no step before the first
        assert clock.dispatched == 3 and clock.blocked_s == 0.0
    finally:
        clock.close()


def test_step_clock_times_the_loops_wait_for_the_device():
    fake = FakeTime()
    device = Device()
    clock = StepClock(lambda state, batch: (state, device), first_step=7, now=fake)
    try:
        clock.wait(6)  # the step before the first: nothing to wait for
        clock("s", "b")

        def finish():  # the device finishes step 7 two seconds into the loop's wait
            fake.t = 2.0
            device.done.set()

        threading.Timer(0.05, finish).start()
        clock.wait(7)
        assert clock.blocked_s == pytest.approx(2.0)
    finally:
        clock.close()


def test_an_intervals_figures_per_step():
    """4 steps in 10 s of wall time, 2 s of it evaluation: loop 2 s per step; of the loop's 8 s, 5 s
    waiting for the device, 1 s for data, 0.5 s for a checkpoint: 1.5 s of other host work."""
    a = Totals(wall=100.0, excluded=1.0, blocked=3.0, data=0.5, stall=0.0, device=7.0)
    b = Totals(wall=110.0, excluded=3.0, blocked=8.0, data=1.5, stall=0.5, device=14.2)
    assert (b - a).per_step(4) == pytest.approx({
        "loop_time_s": 2.0, "step_time_s": 7.2 / 4, "data_wait_s": 0.25, "checkpoint_stall_s": 0.125,
        "host_overhead_s": 1.5 / 4})
    assert (b - a).own_per_step(4) == pytest.approx((8.0 - 5.0) / 4)


def test_loop_times_read_every_clock():
    fake = FakeTime()

    class Clock:
        blocked_s, device_s = 1.0, 2.0

    data = TimedData(iter(()))
    data.wait_s = 3.0
    times = LoopTimes(data, Clock(), now=fake)
    times.stall_s, times.excluded_s, fake.t = 4.0, 5.0, 6.0
    assert times.now() == Totals(wall=6.0, excluded=5.0, blocked=1.0, data=3.0, stall=4.0, device=2.0)
