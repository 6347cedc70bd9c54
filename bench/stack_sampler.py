"""Where one thread's wall clock goes: its Python stack sampled every few ms from another thread.

mlx releases the interpreter lock while it evaluates, so a thread waiting on the device is sampled on the line that
waits (an ``mx.eval``, ``.item()`` or ``.tolist()``): the share of samples on such lines is the time the thread spent
waiting for the device, the rest is Python building graphs. No dependency beyond the standard library.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from typing import Any, Dict, Optional

STALL_MS = 50.0


def _where(frame: Any) -> str:
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"


class StackSampler:
    """Samples the thread named ``thread_name`` every ``interval`` s between start() and stop()."""

    def __init__(self, thread_name: str, interval: float = 0.002, top: int = 25) -> None:
        self.thread_name, self.interval, self.top = thread_name, interval, top
        self.leaf: Counter = Counter()       # the innermost Python line
        self.inclusive: Counter = Counter()  # every function on the stack, once a sample
        self.samples = 0
        self.stalls: list = []  # (ms, where): one unchanged stack for >= STALL_MS (a compile, a long wait)
        self._chain: list = []  # the innermost frames of the stack seen last
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _ident(self) -> Optional[int]:
        return next((t.ident for t in threading.enumerate() if t.name == self.thread_name), None)

    def _run(self) -> None:
        ident = self._ident()
        last: Any = None
        since = time.perf_counter()
        while not self._stop.is_set():
            frame = sys._current_frames().get(ident) if ident is not None else None
            if frame is not None:
                self.samples += 1
                leaf = _where(frame)
                self.leaf[leaf] += 1
                seen, key, chain = set(), [], []
                while frame is not None:
                    code = frame.f_code
                    seen.add(f"{os.path.basename(code.co_filename)} {code.co_name}")
                    key.append((id(frame), frame.f_lineno))
                    if len(chain) < 6:
                        chain.append(_where(frame))
                    frame = frame.f_back
                self.inclusive.update(seen)
                now, key = time.perf_counter(), tuple(key)
                if key != last:
                    self._stall(now - since, self._chain)
                    last, since, self._chain = key, now, chain
            time.sleep(self.interval)
        self._stall(time.perf_counter() - since, self._chain)

    def _stall(self, seconds: float, chain: list) -> None:
        if seconds >= STALL_MS / 1e3 and chain:
            self.stalls.append((round(seconds * 1e3, 1), " < ".join(chain)))

    def _cpu(self) -> float:
        """The sampled thread's CPU seconds so far (Linux); 0.0 where it cannot be read."""
        ident = self._ident()
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident)) if ident is not None else 0.0
        except (AttributeError, OSError):
            return 0.0

    def start(self) -> "StackSampler":
        self._cpu0 = self._cpu()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        n = max(self.samples, 1)
        # CPU time the thread spent (Python building graphs, host-side work), against the wall clock's share
        return {"cpu_s": round(self._cpu() - self._cpu0, 3), "samples": self.samples, "interval_ms": 1e3 * self.interval,
                "leaf_share": {k: round(v / n, 4) for k, v in self.leaf.most_common(self.top)},
                "stalls": {"count": len(self.stalls), "ms": round(sum(ms for ms, _ in self.stalls), 1),
                           "longest": sorted(self.stalls, reverse=True)[:12]},
                "inclusive_share": {k: round(v / n, 4) for k, v in self.inclusive.most_common(self.top)}}
