"""``CpuMeter``: whether other work took a benchmark arm's cores; ``StealMeter``: how much of
the machine's core time its hypervisor took (fake clocks throughout)."""

from __future__ import annotations

from benchmarks.workloads import CpuMeter
from cluster.planner.measure.machine import StealMeter, machine_busy_s, machine_steal_s


class Clocks:
    def __init__(self) -> None:
        self.wall = 0.0
        self.own = 0.0
        self.busy: float | None = 0.0

    def meter(self, threads: int, cores: int) -> CpuMeter:
        return CpuMeter(
            threads,
            num_cores=cores,
            busy=lambda: self.busy,
            own=lambda: self.own,
            clock=lambda: self.wall,
        )

    def run(self, wall: float, own: float, others: float) -> None:
        self.wall += wall
        self.own += own
        assert self.busy is not None
        self.busy += own + others


def test_an_arm_that_idles_its_own_threads_alone_is_not_disturbed() -> None:
    c = Clocks()
    m = c.meter(threads=2, cores=2)
    c.run(wall=10.0, own=13.0, others=0.2)  # batch 1: 65% of two threads, a little background
    assert m.utilisation() > 0.98  # the old measure (own / threads) read 0.65: "disturbed"


def test_other_work_on_the_arms_cores_is_seen() -> None:
    c = Clocks()
    m = c.meter(threads=2, cores=2)
    c.run(wall=10.0, own=12.0, others=8.0)  # another job took most of a core
    assert 0.55 < m.utilisation() < 0.65


def test_other_work_on_cores_the_arm_leaves_free_does_not_count() -> None:
    c = Clocks()
    m = c.meter(threads=2, cores=8)
    c.run(wall=10.0, own=20.0, others=50.0)  # 5 of the 6 other cores busy
    assert m.utilisation() == 1.0
    m = c.meter(threads=2, cores=8)
    c.run(wall=10.0, own=20.0, others=70.0)  # 7 cores: the 6 spare ones and one of the arm's 2
    assert 0.45 < m.utilisation() < 0.55


def test_without_proc_stat_it_falls_back_to_the_processes_own_share() -> None:
    c = Clocks()
    c.busy = None
    m = c.meter(threads=2, cores=2)
    c.wall, c.own = 10.0, 13.0
    assert abs(m.utilisation() - 0.65) < 1e-9


def test_the_machine_counter_moves_on_this_host() -> None:
    busy = machine_busy_s()
    if busy is None:  # not Linux
        return
    t = busy
    x = 0
    for i in range(3_000_000):  # some CPU work of our own
        x += i
    after = machine_busy_s()
    assert after is not None and after > t


def test_the_steal_share_is_the_hypervisors_time_over_every_cores_wall_time() -> None:
    clock = {"wall": 10.0, "steal": 3.0}
    meter = StealMeter(num_cores=2, steal=lambda: clock["steal"], clock=lambda: clock["wall"])
    clock["wall"] += 4.0  # 8 core-seconds, of which the hypervisor took 2
    clock["steal"] += 2.0
    assert meter.share() == 0.25
    unknown = StealMeter(num_cores=2, steal=lambda: None, clock=lambda: clock["wall"])
    clock["wall"] += 1.0
    assert unknown.share() is None


def test_this_machines_steal_counter_reads() -> None:
    stolen = machine_steal_s()
    assert stolen is None or stolen >= 0.0
