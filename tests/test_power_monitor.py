"""benchmarks/mla_bench/power.py on the CPU, against a stand-in for NVML: the window's power from the energy counter
(or from sampled power where the board has no counter), the SM clock's mean and lowest sample, the share of samples
with a clock-lowering reason, and the errors where NVML cannot be used."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from mla_bench import power  # noqa: E402


class FakeNvml:
    """The NVML calls power.py makes. Energy grows at `watts` with wall time; the SM clock and the reasons cycle."""
    NVML_CLOCK_SM = 1

    def __init__(self, watts=600.0, clocks=(1980, 1845), reasons=(0x4, 0x0), energy=True, count=1,
                 init_error=None, by_bus=True):
        self.watts, self.clocks, self.reasons = watts, clocks, reasons
        self.energy, self.count, self.init_error, self.by_bus = energy, count, init_error, by_bus
        self.t0 = time.perf_counter()
        self.n_clock = self.n_reason = 0

    def nvmlInit(self):
        if self.init_error:
            raise RuntimeError(self.init_error)

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        if not self.by_bus:
            raise RuntimeError("not found")
        return ("bus", bus)

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("index", i)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.energy:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return int((time.perf_counter() - self.t0) * self.watts * 1000)  # mJ

    def nvmlDeviceGetPowerUsage(self, handle):
        return int(self.watts * 1000)  # mW

    def nvmlDeviceGetClockInfo(self, handle, which):
        assert which == self.NVML_CLOCK_SM
        c = self.clocks[self.n_clock % len(self.clocks)]
        self.n_clock += 1
        return c

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        r = self.reasons[self.n_reason % len(self.reasons)]
        self.n_reason += 1
        return r


def _window(nvml, seconds=0.05):
    monitor = power.PowerMonitor(nvml, ("index", 0), period_s=0.002)
    with monitor.window() as reading:
        time.sleep(seconds)
    assert monitor.last is reading  # what graph_replay_us's callers read
    return reading


def test_window_reads_power_from_the_energy_counter():
    r = _window(FakeNvml(watts=612.0))
    assert r.samples >= 2 and r.seconds >= 0.05
    assert r.watts == pytest.approx(612.0, rel=0.05)
    assert r.sm_mhz_min == 1845 and 1845 <= r.sm_mhz_mean <= 1980
    assert 0.25 <= r.capped_fraction <= 0.75  # every other sample carries the power-cap reason
    assert r.describe().startswith(f"{r.watts:.0f} W, SM ") and "min 1845" in r.describe()
    assert set(r.as_dict()) == {"watts", "sm_mhz_mean", "sm_mhz_min", "capped_fraction", "samples"}


class SteppedCounter(FakeNvml):
    """An energy counter the driver updates in steps `step_s` apart, as on an H200 (tens of milliseconds)."""

    def __init__(self, step_s=0.02, **kw):
        super().__init__(**kw)
        self.step_s = step_s

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        t = time.perf_counter() - self.t0
        return int((t // self.step_s) * self.step_s * self.watts * 1000)


def test_power_is_taken_between_the_counters_updates():
    # Ends of the window would give 0 W or a step too many; the updates inside it give the power.
    r = _window(SteppedCounter(step_s=0.02, watts=580.0), seconds=0.2)
    assert r.watts == pytest.approx(580.0, rel=0.1)


def test_a_window_shorter_than_two_updates_gets_no_power():
    r = _window(SteppedCounter(step_s=0.5, watts=580.0), seconds=0.05)
    assert r.watts is None and r.sm_mhz_mean is not None
    assert r.describe().startswith("power n/a, SM ")


def test_window_falls_back_to_sampled_power_without_a_counter():
    r = _window(FakeNvml(watts=450.0, energy=False, reasons=(0x0,)))
    assert r.watts == pytest.approx(450.0)
    assert r.capped_fraction == 0.0


def test_reasons_that_do_not_lower_the_clock_are_not_counted():
    # 0x1: the GPU idles (no load), 0x2: application clocks setting; neither is power or heat
    r = _window(FakeNvml(reasons=(0x1, 0x2)))
    assert r.capped_fraction == 0.0
    r = _window(FakeNvml(reasons=(0x8, 0x20, 0x40, 0x80)))
    assert r.capped_fraction == 1.0


def test_the_older_reasons_call_is_used_where_the_newer_is_missing():
    class Older(FakeNvml):
        nvmlDeviceGetCurrentClocksEventReasons = None  # absent from older nvidia-ml-py releases

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
            return 0x4

    assert _window(Older()).capped_fraction == 1.0


def test_open_monitor_without_the_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(power.PowerUnavailable, match="pip install nvidia-ml-py"):
        power.open_monitor()


def test_open_monitor_reports_nvml_that_does_not_start():
    with pytest.raises(power.PowerUnavailable, match="NVML did not start: no driver"):
        power.open_monitor(nvml=FakeNvml(init_error="no driver"))


def test_open_monitor_never_guesses_among_several_gpus(monkeypatch):
    # torch gives no PCI bus id here (no GPU, or the lookup fails): with one GPU in NVML that one is taken,
    # with two the monitor refuses rather than watch the wrong one.
    import torch

    def no_props(*a, **k):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_props)
    assert power.open_monitor(nvml=FakeNvml(count=1)).handle == ("index", 0)
    with pytest.raises(power.PowerUnavailable, match="among 2 GPUs"):
        power.open_monitor(nvml=FakeNvml(count=2, by_bus=False))


def test_open_monitor_matches_the_cuda_device_by_its_bus_id(monkeypatch):
    import torch

    class Props:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x1B, 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monitor = power.open_monitor(nvml=FakeNvml(count=8))
    assert monitor.handle == ("bus", "00000000:1b:00.0")


def test_reading_without_samples_says_so():
    assert power.Reading().describe() == "power: no readings"


def test_a_reading_the_board_refuses_is_left_out():
    class NoClocks(FakeNvml):
        def nvmlDeviceGetClockInfo(self, handle, which):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    r = _window(NoClocks(watts=500.0, reasons=(0x0,)))
    assert r.sm_mhz_mean is None and r.watts == pytest.approx(500.0, rel=0.05) and r.capped_fraction == 0.0
    assert r.describe() == f"{r.watts:.0f} W, SM clock n/a, clock lowered by power or heat in 0% of samples"


# ---- the benchmark harness's --power (benchmarks/bench.py) --------------------------------------------------------

def test_with_power_puts_the_window_in_the_timing_and_the_row():
    from mla_bench import report, run, shapes, timing

    monitor = power.PowerMonitor(FakeNvml(watts=640.0, clocks=(1900,), reasons=(0x4,)), ("index", 0), period_s=0.002)

    def fake_timer(fn, warmup_ms, rep_ms):
        fn()
        time.sleep(0.02)
        return timing.Timing(350.0, 349.0, 351.0, "fake")

    timed = timing.with_power(fake_timer, monitor)
    assert timed.__name__ == "fake_timer"  # the harness names the timer in its log
    calls = []
    t = timed(lambda: calls.append(1), 25, 100)
    assert calls == [1] and t.median_us == 350.0 and t.method == "fake"
    assert t.power["watts"] == pytest.approx(640.0, rel=0.1) and t.power["sm_mhz_mean"] == 1900
    assert t.power["capped_fraction"] == 1.0

    cfg = run.Config(shapes=[], impls=["ours"])
    work = shapes.count_work([8192] * 4, 16, 1, True, 2)
    row = run.base_row(shapes.Shape(4, 8192, 16), cfg, work, 1, "ours", "graph")
    assert {"watts", "sm_mhz", "sm_mhz_min", "clock_capped"} <= set(report.CSV_FIELDS)
    assert report.power_table([row]) == []  # no --power: no table
    run.fill_timing(row, t, work, None)
    assert row["sm_mhz"] == 1900 and row["sm_mhz_min"] == 1900 and row["clock_capped"] == 1.0
    assert "SM 1900 MHz (min 1900), clock lowered by power or heat in 100% of samples" in run.progress_line(1, 1, row)
    table = report.power_table([row])
    assert table[-1].startswith("| b4-sk8192-h16-sq1 | ours | graph | 350.0 | ") and "1900 / 1900" in table[-1]


def test_bench_takes_power():
    from mla_bench import cli

    assert cli.parse_args(["--power"]).power and not cli.parse_args([]).power
