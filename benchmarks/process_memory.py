"""This process's memory as Linux reports it, for the memory benchmarks (checkpoint_stall.py, model_memory.py):
RSS and its peak (``VmRSS``, ``VmHWM``), resetting the peak, and the peak of anonymous memory sampled on a thread."""
from __future__ import annotations

import threading
import time


def memory(field: str) -> int:
    """VmRSS / VmHWM of this process in bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``); returns the RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    return memory("VmRSS")


class AnonPeak:
    """The peak of RssAnon (memory that is not a mapped file's pages) above its value at start, sampled every
    millisecond on a thread: VmHWM also counts the page-cache pages a mapped file shows, which the kernel can drop."""

    def __init__(self) -> None:
        self.base = self.peak = memory("RssAnon")
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, memory("RssAnon"))
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return max(self.peak, memory("RssAnon")) - self.base
