"""What the GPU was doing while a benchmark timed something: SM clock, power, temperature and the
driver's clock-limit reasons, sampled through NVML (``nvidia-ml-py``, imported as ``pynvml``) by a
background thread.

An H200 at its power limit lowers its SM clock by a few percent, by an amount that depends on the
chip, its temperature and the kernel (a pure FP8 GEMM runs at ~1.3 GHz, our attention kernel near
1.85 GHz): the same kernel can time 3-8% apart between two calls. A timing that carries the clock it
ran at can be compared across runs; one that does not cannot.

Usage::

    sampler = GpuSampler()            # never raises: without NVML every window reports available=False
    with sampler.window() as w:
        ms = do_bench(fn)
    w.summary()  # {"available": True, "samples": 37, "sm_mhz": 1845.0, "power_w": 689.5, ...}

Reading only: nothing here changes a clock, a limit or any other setting of the device.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

# NVML clock-event (throttle) reason bits, from nvml.h
_POWER_CAP = 0x4  # software power cap
_HW_SLOWDOWN = 0x8 | 0x80  # hardware slowdown, power brake
_THERMAL = 0x20 | 0x40  # software / hardware thermal slowdown


class _Window:
    def __init__(self):
        self.samples: list[tuple[float, float, float, int]] = []  # (sm MHz, power W, temp C, reasons)
        self.error = ""

    def summary(self) -> dict:
        """Medians of the SM clock and power, the maximum temperature, and the share of samples in which
        the driver named the power cap / a thermal or hardware slowdown as a clock limit."""
        if not self.samples:
            return {"available": False, "samples": 0, "error": self.error or "no sample taken"}
        n = len(self.samples)
        return {"available": True, "samples": n,
                "sm_mhz": statistics.median(s[0] for s in self.samples),
                "sm_mhz_min": min(s[0] for s in self.samples),
                "power_w": statistics.median(s[1] for s in self.samples),
                "temp_c_max": max(s[2] for s in self.samples),
                "power_capped_share": sum(1 for s in self.samples if s[3] & _POWER_CAP) / n,
                "thermal_or_hw_share": sum(1 for s in self.samples if s[3] & (_THERMAL | _HW_SLOWDOWN)) / n}


class GpuSampler:
    """Samples GPU ``index`` every ``interval_s`` while a :meth:`window` is open."""

    def __init__(self, index: int = 0, interval_s: float = 0.01, *, off_reason: str = ""):
        """``off_reason``: sample nothing (a run that does not use the GPU), every window reporting it."""
        self.interval_s = interval_s
        self.error = off_reason
        self._nvml = None
        self._handle = None
        if off_reason:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception as exc:  # noqa: BLE001 - no NVML: timings still run, without the GPU's state
            self.error = f"NVML unavailable: {type(exc).__name__}: {exc}"

    def _reasons(self) -> int:
        nv = self._nvml
        getter = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(getter(self._handle))

    def sample(self) -> tuple[float, float, float, int]:
        nv = self._nvml
        return (float(nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM)),
                nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0,
                float(nv.nvmlDeviceGetTemperature(self._handle, nv.NVML_TEMPERATURE_GPU)),
                self._reasons())

    @contextlib.contextmanager
    def window(self):
        """Context manager yielding a window whose :meth:`_Window.summary` covers the time it was open."""
        win = _Window()
        if self._nvml is None:
            win.error = self.error
            yield win
            return
        stop = threading.Event()

        def run():
            while not stop.is_set():
                try:
                    win.samples.append(self.sample())
                except Exception as exc:  # noqa: BLE001 - a failed read ends the window's sampling
                    win.error = f"{type(exc).__name__}: {exc}"
                    return
                time.sleep(self.interval_s)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            yield win
        finally:
            stop.set()
            thread.join()
