"""The server's prompt cache: finished requests' caches, reused by later requests that share a prefix.

A chat client resends the whole conversation every turn, so turn n+1's prompt starts with turn n's
prompt and answer. The scheduler (hooks/scheduler.py) keeps each finished (or cancelled) request's
target caches here with what its plugins saved for the same tokens (``host_save_row``: the
drafter's state), and a new request takes a copy of the entry with the longest usable common
prefix, so its prefill runs only the new tokens.

What carries over from mlx-lm's server (``LRUPromptCache``, mlx-lm 0.32.2):
- attention caches (``KVCache``) are trimmed to the shared prefix (``trim``), so one entry serves
  every prefix of its tokens, and a new trimmable entry replaces the entries it extends;
- recurrent caches (``ArraysCache``: a state, not positions) and sliding windows that have wrapped
  cannot be trimmed: such entries are snapshots usable only at exactly their length, so the
  scheduler keeps one at the end of each request's prompt and one at the end of its generation,
  and a hit restores the largest snapshot position <= the shared prefix;
- at least one prompt token is always fed (it gives the first token's logits): a hit restores at
  most ``len(prompt) - 1`` positions;
- entries are evicted least recently used first, here bounded in bytes (target and plugin state).

A row whose plugins read the target's captured layer outputs (``state.capture_layers``, e.g. DFlash)
reuses only positions every saved plugin state covers: the host cannot re-create the captures of
positions it does not feed. Entries hold copies: arrays are shared until either side writes
(``cache_ops.handle``), so an entry never changes after it is made.
"""

from __future__ import annotations

import copy
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, ConcatenateKVCache, KVCache, QuantizedKVCache

from .cache_ops import handle
from .specs import Metric, RowSnapshot

DEFAULT_FRACTION = 4  # the default bound: (device memory - the target's weights) / 4


# -- cache copies ------------------------------------------------------------------------------

def _copy_value(value: Any) -> Any:
    if isinstance(value, mx.array):
        return handle(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_copy_value(v) for v in value)
    if hasattr(value, "is_trimmable") and hasattr(value, "__dict__"):
        return copy_cache(value)
    return value


def copy_cache(cache: Any) -> Any:
    """An independent copy of one cache object (its class and every attribute; arrays as handles)."""
    out = copy.copy(cache)
    out.__dict__.update({k: _copy_value(v) for k, v in vars(cache).items()})
    return out


def copy_caches(caches: Sequence[Any]) -> List[Any]:
    return [copy_cache(c) for c in caches]


def _walk(value: Any, seen: Dict[int, mx.array]) -> None:
    if isinstance(value, mx.array):
        seen.setdefault(id(value), value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk(v, seen)
    elif hasattr(value, "__dict__") and hasattr(value, "is_trimmable"):
        for v in vars(value).values():
            _walk(v, seen)


def arrays(caches: Sequence[Any]) -> List[mx.array]:
    """Every array the caches hold, once each (module-level recursion: a closure calling itself
    would keep the arrays alive in a reference cycle until the next garbage collection)."""
    seen: Dict[int, mx.array] = {}
    _walk(list(caches), seen)
    return list(seen.values())


def cache_bytes(caches: Sequence[Any]) -> int:
    """Bytes the caches hold (whole buffers, as allocated)."""
    return sum(a.nbytes for a in arrays(caches))


def trimmable(caches: Sequence[Any]) -> bool:
    """mlx-lm's rule: every cache can drop positions now."""
    return all(c.is_trimmable() for c in caches)


def trim_caches(caches: Sequence[Any], n: int) -> None:
    """Drop the last n positions of every cache (in place)."""
    if n > 0:
        for c in caches:
            c.trim(n)


def _prefix_only(cache: Any) -> bool:
    if isinstance(cache, CacheList):
        return all(_prefix_only(c) for c in cache.caches)
    return isinstance(cache, (KVCache, QuantizedKVCache, ConcatenateKVCache))


def always_trimmable(caches: Sequence[Any]) -> bool:
    """Whether every cache keeps positions as a prefix (attention KV): trimmable at any length, so
    a request needs no snapshot at the end of its prompt."""
    return all(_prefix_only(c) for c in caches)


# -- the default bound -------------------------------------------------------------------------

def device_memory() -> int:
    """Bytes of memory the default device has (Metal / CUDA: its own; CPU: the machine's RAM)."""
    try:
        size = int(mx.device_info().get("memory_size", 0))
    except (AttributeError, RuntimeError, ValueError):
        size = 0
    if size <= 0:
        size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return size


def weight_bytes(model: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def default_bytes(model: Any, memory: Optional[int] = None) -> int:
    """``server.prompt_cache_bytes``'s default: a quarter of the device memory left after the
    target's weights, max((memory - weights) / 4, 0)."""
    memory = device_memory() if memory is None else memory
    return max(0, (memory - weight_bytes(model)) // DEFAULT_FRACTION)


# -- the cache ---------------------------------------------------------------------------------

@dataclass(eq=False)  # entries are compared by identity (list.remove), never by their arrays
class Entry:
    tokens: np.ndarray  # [P] the tokens the caches hold, in order
    caches: List[Any]  # per layer: one row's caches (plain mlx-lm cache classes)
    trimmable: bool  # usable at any prefix (else only at exactly P positions)
    snapshots: Dict[str, RowSnapshot]  # plugin name -> its state for (a prefix of) the same tokens
    nbytes: int
    used: int = 0  # LRU clock
    captures: bool = False  # made by a row that captures: its snapshots' coverage limits such rows


@dataclass
class Hit:
    caches: List[Any]  # copies holding the first ``positions`` prompt tokens
    positions: int
    snapshots: Dict[str, RowSnapshot]


class PromptCache:
    """Entries bounded by ``max_bytes`` (target and plugin state) and, if given, ``max_entries`` (mlx-lm's
    ``--prompt-cache-size``), least recently used out first."""

    def __init__(self, max_bytes: int, max_entries: Optional[int] = None):
        if max_bytes < 0:
            raise ValueError(f"prompt cache bound: got {max_bytes} bytes; expected >= 0")
        self.max_bytes = int(max_bytes)
        self.max_entries = max_entries
        self.entries: List[Entry] = []
        self.nbytes = 0
        self._clock = 0
        self._lock = threading.Lock()  # /metrics reads the counters from HTTP threads
        self.hits = self.misses = self.reused_tokens = self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @staticmethod
    def usable(entry: Entry, prompt: np.ndarray, captures: bool) -> int:
        """Positions of ``entry`` a request with ``prompt`` can start from (0: none)."""
        size = len(entry.tokens)
        m = min(size, len(prompt) - 1)  # at least one prompt token is fed
        if m <= 0:
            return 0
        diff = np.flatnonzero(entry.tokens[:m] != prompt[:m])
        n = int(diff[0]) if diff.size else m
        if not entry.trimmable and n < size:
            return 0  # a snapshot: only exactly its own length
        if captures:
            if not entry.snapshots:
                return 0
            cover = min(s.positions for s in entry.snapshots.values())
            if cover < n:
                n = cover if entry.trimmable else 0
        return max(n, 0)

    def fetch(self, prompt: Sequence[int], captures: bool = False) -> Optional[Hit]:
        """Copies of the target caches for the longest usable prefix of ``prompt``, or None.

        ``captures``: the request's plugins read captured layer outputs (see the module doc)."""
        p = np.asarray(prompt, dtype=np.int64)
        best, best_n = None, 0
        for entry in self.entries:
            n = self.usable(entry, p, captures)
            if n > best_n or (n == best_n and n > 0 and best is not None and entry.used > best.used):
                best, best_n = entry, n
        with self._lock:
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            self.reused_tokens += best_n
        best.used = self._tick()
        caches = copy_caches(best.caches)
        trim_caches(caches, len(best.tokens) - best_n)
        return Hit(caches, best_n, dict(best.snapshots))

    def insert(self, tokens: Sequence[int], caches: List[Any], snapshots: Dict[str, RowSnapshot],
               captures: bool = False) -> bool:
        """Keep ``caches`` (they hold exactly ``tokens``; the cache owns them from now on) with the
        plugins' ``snapshots`` (``captures``: the row that made them captures layer outputs).
        Returns False when the entry alone exceeds the bound."""
        snapshots = {k: v for k, v in snapshots.items() if v is not None}
        mx.eval(arrays(caches))
        nbytes = cache_bytes(caches) + sum(int(s.nbytes) for s in snapshots.values())
        if nbytes > self.max_bytes or len(tokens) == 0:
            return False
        entry = Entry(np.asarray(tokens, dtype=np.int64), caches, trimmable(caches), snapshots, nbytes, self._tick(),
                      captures)
        keep = []
        for old in self.entries:
            if self._same_or_covered(old, entry):
                self.nbytes -= old.nbytes  # this entry serves every request the old one served
            else:
                keep.append(old)
        dropped = len(self.entries) - len(keep)
        self.entries = keep + [entry]
        self.nbytes += nbytes
        dropped += self._evict()
        if dropped:
            # Give the dropped entries' buffers back: parked in mlx's buffer cache they would still
            # hold the memory the bound is meant to free.
            mx.clear_cache()
        return True

    @staticmethod
    def _same_or_covered(old: Entry, new: Entry) -> bool:
        n = len(old.tokens)
        if n > len(new.tokens) or not np.array_equal(old.tokens, new.tokens[:n]):
            return False
        if n < len(new.tokens) and not (old.trimmable and new.trimmable):
            return False
        # The new entry serves every request the old one served (the same tokens, or a trimmable
        # extension), with the same plugins' state, covering as much where rows that capture need it.
        return all(k in new.snapshots and (new.snapshots[k].positions >= s.positions or not old.captures)
                   for k, s in old.snapshots.items())

    def _evict(self) -> int:
        evicted = 0
        while self.entries and (self.nbytes > self.max_bytes or
                                (self.max_entries is not None and len(self.entries) > self.max_entries)):
            oldest = min(self.entries, key=lambda e: e.used)
            self.entries.remove(oldest)
            self.nbytes -= oldest.nbytes
            evicted += 1
        with self._lock:
            self.evictions += evicted
        return evicted

    def clear(self) -> None:
        self.entries, self.nbytes = [], 0


def describe(cache: Optional[PromptCache], configured: bool, entries: Optional[int] = None) -> str:
    """The start log's line (``configured``: the bound was set, not the default)."""
    if cache is None:
        return "off (server.prompt_cache_size is 0)" if entries == 0 else "off (server.prompt_cache_bytes is 0)"
    source = "server.prompt_cache_bytes" if configured else "the default: (device memory - the target's weights) / 4"
    count = f", at most {cache.max_entries} entries (server.prompt_cache_size)" if cache.max_entries is not None else ""
    return f"up to {cache.max_bytes / 2**20:.1f} MiB of finished requests' caches ({source}){count}"


def metrics(cache: Optional[PromptCache]) -> List[Metric]:
    """The prompt cache's Prometheus metrics (zeros when it is off)."""
    if cache is None:
        hits = misses = reused = evictions = held = entries = limit = 0
    else:
        with cache._lock:
            hits, misses, reused, evictions = cache.hits, cache.misses, cache.reused_tokens, cache.evictions
        held, entries, limit = cache.nbytes, len(cache.entries), cache.max_bytes
    return [
        Metric("mlx_spec_prompt_cache_hits_total", "counter", "Requests that started from a cached prefix.",
               [("", hits)]),
        Metric("mlx_spec_prompt_cache_misses_total", "counter", "Requests that found no usable cached prefix.",
               [("", misses)]),
        Metric("mlx_spec_prompt_cache_reused_tokens_total", "counter",
               "Prompt tokens taken from the prompt cache instead of prefilled.", [("", reused)]),
        Metric("mlx_spec_prompt_cache_evictions_total", "counter", "Entries evicted (least recently used first).",
               [("", evictions)]),
        Metric("mlx_spec_prompt_cache_bytes", "gauge", "Bytes the prompt cache holds (target and drafter state).",
               [("", held)]),
        Metric("mlx_spec_prompt_cache_entries", "gauge", "Entries in the prompt cache.", [("", entries)]),
        Metric("mlx_spec_prompt_cache_limit_bytes", "gauge", "server.prompt_cache_bytes (0: the cache is off).",
               [("", limit)]),
    ]
