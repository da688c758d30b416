"""Device time of eviction steps, read without a host sync.

On CUDA the eviction step only launches kernels: its host wall time (`time.perf_counter`
around the step, what the scheduler thread waited for) says little about how long the GPU
spends on it. A StepTimer records a CUDA event before and after each step on the stream the
step runs on, and reads the pairs whose end event has completed (`Event.query()`, which never
blocks) at later steps: device times arrive a step or more late, and nothing waits for them.
On CPU the ops run synchronously, so a step's device time is its host time.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class StepTimer:
    MAX_PENDING = 256  # unread steps kept; older ones are dropped (counted in `dropped`)

    def __init__(self, device, event_factory=None):
        self.on_cuda = torch.device(device).type == "cuda"
        self._event = event_factory or (
            (lambda: torch.cuda.Event(enable_timing=True)) if self.on_cuda else None)
        self._pending: deque = deque()
        self._start = None
        self.dropped = 0

    def start(self) -> None:
        if self._event is not None:
            self._start = self._event()
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._event is not None:
            end = self._event()
            end.record()
            self._pending.append((self._start, end))
        else:
            self._pending.append(time.perf_counter() - self._start)
        self._start = None
        if len(self._pending) > self.MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1

    def finished(self) -> list[float]:
        """Seconds of every recorded step that has finished on the device, oldest first;
        the others stay pending. Never waits."""
        done = []
        while self._pending:
            item = self._pending[0]
            if self._event is not None:
                start, end = item
                if not end.query():
                    break
                done.append(start.elapsed_time(end) / 1e3)  # milliseconds
            else:
                done.append(item)
            self._pending.popleft()
        return done
