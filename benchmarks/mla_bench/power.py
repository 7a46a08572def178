"""The GPU's power draw and SM clock over a timed window, read through NVML (the `nvidia-ml-py` package, module
`pynvml`).

Why: a kernel that keeps the tensor cores busy can reach the board's power limit within a second, and the driver
then lowers the SM clock. A timing window of 25 ms may end before that and one of 100 ms may not, so two harnesses
can time the same kernel 5-8% apart while a slower peer, below the limit, times the same in both
(docs/perf/journal.md). A serving engine runs at the sustained clock. With the window's power and clocks printed
beside each time, a comparison says at which clock it was made.

    monitor = open_monitor(torch.device("cuda"))     # raises PowerUnavailable, with the reason, where NVML is not
    with monitor.window() as reading:                 # usable
        ...timed work...
    reading.watts, reading.sm_mhz_mean, reading.sm_mhz_min, reading.capped_fraction
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Iterator, Optional

# NVML's clock-event (throttle) reasons that lower the clock below what the load asks for: the software power cap,
# hardware slowdown, software and hardware thermal slowdown, the power brake.
CAP_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
SAMPLE_PERIOD_S = 0.005


class PowerUnavailable(RuntimeError):
    """NVML cannot be read here (the package is missing, or the driver refuses); the message says which."""


@dataclasses.dataclass
class Reading:
    seconds: float = 0.0
    watts: Optional[float] = None        # average power over the window (energy counter, else sampled power); None
                                         # where the window held fewer than two of the counter's updates
    sm_mhz_mean: Optional[float] = None  # SM clock, mean and lowest of the samples
    sm_mhz_min: Optional[float] = None
    capped_fraction: Optional[float] = None  # share of the samples with a clock-lowering reason (CAP_REASONS)
    samples: int = 0

    def describe(self) -> str:
        return describe_power(self.watts, self.sm_mhz_mean, self.sm_mhz_min, self.capped_fraction, self.samples)

    def as_dict(self) -> dict:
        return {"watts": None if self.watts is None else round(self.watts, 1),
                "sm_mhz_mean": None if self.sm_mhz_mean is None else round(self.sm_mhz_mean),
                "sm_mhz_min": self.sm_mhz_min, "capped_fraction": self.capped_fraction, "samples": self.samples}


def describe_power(watts: Optional[float], sm_mhz: Optional[float], sm_mhz_min: Optional[float],
                   capped_fraction: Optional[float], samples: Optional[int] = None) -> str:
    """A window's readings in words; a reading the board did not give is said to be missing."""
    if watts is None and sm_mhz is None:
        return "power: no readings"
    parts = ["power n/a" if watts is None else f"{watts:.0f} W"]
    parts.append("SM clock n/a" if sm_mhz is None else f"SM {sm_mhz:.0f} MHz (min {sm_mhz_min:.0f})")
    if capped_fraction is not None:
        of = f" of {samples} samples" if samples else " of samples"
        parts.append(f"clock lowered by power or heat in {100 * capped_fraction:.0f}%{of}")
    return ", ".join(parts)


class PowerMonitor:
    """Samples one GPU's SM clock and clock-event reasons every `period_s` seconds on a thread while a window is open,
    and its energy counter (or, on a board without one, its power) at every sample. `nvml` is the pynvml module or a
    stand-in with the same functions (the tests use one).

    The energy counter does not count continuously: the driver adds to it in steps, so its difference over a
    window shorter than a few steps is zero or a step too many (on an H200, driver 580: a 25 ms window read 0 W, or
    949 W on a 700 W board; most 100 ms windows held fewer than two steps). The power is therefore taken between the
    first and the last update seen inside the window: the energy the counter gained from one to the other over the
    time between them. A window that holds fewer than two updates gets no power (None) rather than a wrong one;
    windows of a second (fp8_kernel_sweep.py --sustain 1000) read 683-700 W at the board's 700 W cap."""

    def __init__(self, nvml: Any, handle: Any, period_s: float = SAMPLE_PERIOD_S):
        self.nvml, self.handle, self.period_s = nvml, handle, period_s
        self.last: Optional[Reading] = None  # the reading of the latest window
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def _energy_mj(self) -> Optional[int]:
        try:
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception:  # not every board or driver counts energy; the sampled power is used then
            return None

    @contextlib.contextmanager
    def window(self) -> Iterator[Reading]:
        """A window: the reading it yields is filled when it closes, and kept as self.last."""
        reading = self.last = Reading()
        clocks: list[float] = []
        capped: list[bool] = []
        watts: list[float] = []
        updates: list[tuple[float, int]] = []  # (time first seen, value) of each energy counter value after the first
        stop = threading.Event()
        has_counter = self._energy_mj() is not None

        def read(into: list, call) -> None:  # a reading the board refuses is left out, not fatal to the window
            try:
                into.append(call())
            except Exception:
                pass

        def sample() -> None:
            last = self._energy_mj() if has_counter else None
            while True:
                if has_counter:
                    e = self._energy_mj()
                    if e is not None and last is not None and e != last:
                        updates.append((time.perf_counter(), e))
                    last = e if e is not None else last
                else:
                    read(watts, lambda: self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0)
                read(clocks, lambda: float(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)))
                read(capped, lambda: bool(int(self._reasons(self.handle)) & CAP_REASONS))
                if stop.wait(self.period_s):
                    return

        t0 = time.perf_counter()
        thread = threading.Thread(target=sample, name="power-monitor", daemon=True)
        thread.start()
        try:
            yield reading
        finally:
            stop.set()
            thread.join()
            reading.seconds = time.perf_counter() - t0
            reading.samples = len(clocks)
            if clocks:
                reading.sm_mhz_mean = sum(clocks) / len(clocks)
                reading.sm_mhz_min = min(clocks)
            if capped:
                reading.capped_fraction = sum(capped) / len(capped)
            if has_counter:
                if len(updates) >= 2 and updates[-1][0] > updates[0][0]:
                    (ta, ea), (tb, eb) = updates[0], updates[-1]
                    reading.watts = (eb - ea) / 1000.0 / (tb - ta)
            elif watts:
                reading.watts = sum(watts) / len(watts)


def open_monitor(device: Any = None, nvml: Any = None) -> PowerMonitor:
    """A monitor of the GPU that torch calls `device` (default: the current one), found by its PCI bus id, since
    NVML numbers GPUs without regard to CUDA_VISIBLE_DEVICES. Raises PowerUnavailable naming what is missing."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as e:
            raise PowerUnavailable(f"power readings need NVML's Python binding: pip install nvidia-ml-py ({e})")
    try:
        nvml.nvmlInit()
    except Exception as e:
        raise PowerUnavailable(f"NVML did not start: {e}")
    handle = None
    try:
        import torch

        props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:
        handle = None
    if handle is None:  # only where that cannot be the wrong GPU
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            raise PowerUnavailable(f"NVML found no GPU: {e}")
        if count != 1:
            raise PowerUnavailable(f"NVML could not match the CUDA device by its PCI bus id among {count} GPUs")
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
    return PowerMonitor(nvml, handle)
