"""How long a plain (non-speculative) decode step takes at a given batch size.

The speedup estimate needs the cost of the steps speculation replaces. The
engine times plain decode forwards at start-up for batch sizes 1, 2, 4, ...
(calibration) and keeps refining the figures with an exponential moving
average whenever a real step runs without drafts.
"""
from __future__ import annotations

import math
import time
from typing import Callable


class PlainStepTimer:
    def __init__(self, smoothing: float = 0.1):
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}   # power-of-two batch bucket -> seconds per step

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))

    def observe(self, batch_size: int, seconds: float) -> None:
        b = self.bucket(batch_size)
        old = self.seconds.get(b)
        self.seconds[b] = seconds if old is None else old + self.smoothing * (seconds - old)

    def estimate(self, batch_size: int) -> float | None:
        """Seconds per plain step at this batch size, from the nearest measured bucket at or above it."""
        if not self.seconds:
            return None
        b = self.bucket(batch_size)
        above = [k for k in self.seconds if k >= b]
        return self.seconds[min(above)] if above else self.seconds[max(self.seconds)] * b / max(self.seconds)

    def calibrate(self, run_decode_step: Callable[[int], None], max_batch: int, repeats: int = 3) -> None:
        """Time run_decode_step(batch) for batch = 1, 2, 4, ... up to max_batch (first call is warm-up)."""
        batch = 1
        while batch <= max_batch:
            run_decode_step(batch)
            start = time.perf_counter()
            for _ in range(repeats):
                run_decode_step(batch)
            self.seconds[batch] = (time.perf_counter() - start) / repeats
            batch *= 2
