"""The server's metrics: its own counters, the plugins' (``host_metrics``), llama.cpp-style timings."""

from __future__ import annotations

import collections
import threading
from typing import Any, Dict, List, Optional, Tuple

from .specs import DecodeReport, Metric


MAX_IGNORED_NAMES = 64  # distinct ignored field names counted by name; more are counted as "other"


class HostCounters:
    """Requests, tokens and scheduling, thread-safe; rendered by /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Dict[Tuple[str, str], int] = collections.Counter()  # (endpoint, outcome)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.speculative_off_requests = 0  # requests that asked for plain decoding
        self.fallback_requests = 0  # requests whose drafter failed mid-way (plain decoding after)
        self.startup_fallback = 0  # 1: the drafter could not be attached at start, serving plain
        self.speculative_active = 0  # 1: a drafter is attached
        self.running = 0
        self.waiting = 0
        self.batching = 0  # 1: requests may share decode steps
        self.decode_steps = 0  # decode steps (one target forward each)
        self.decode_rows = 0  # rows over all decode steps: / decode_steps = mean rows per forward
        self.ignored_fields: Dict[str, int] = collections.Counter()  # request fields ignored, by name
        self.prefill_seconds = 0.0  # the generation thread's wall clock in prompt chunks ...
        self.decode_seconds = 0.0  # ... and in decode steps (the rest: waiting for requests, emitting)

    def request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] += 1

    def finished(self, endpoint: str, outcome: str, prompt: int, generated: int, off: bool, fallback: bool) -> None:
        with self._lock:
            self.requests[(endpoint, outcome)] += 1
            self.prompt_tokens += prompt
            self.generation_tokens += generated
            self.speculative_off_requests += int(off)
            self.fallback_requests += int(fallback)

    def ignored(self, names: Tuple[str, ...]) -> None:
        with self._lock:
            for name in names:
                known = name in self.ignored_fields or len(self.ignored_fields) < MAX_IGNORED_NAMES
                self.ignored_fields[name if known else "other"] += 1

    def stepped(self, rows: int) -> None:
        with self._lock:
            self.decode_steps += 1
            self.decode_rows += rows

    def spent(self, prefill: float, decode: float) -> None:
        with self._lock:
            self.prefill_seconds += prefill
            self.decode_seconds += decode

    def metrics(self) -> List[Metric]:
        with self._lock:
            requests = sorted(self.requests.items())
            ignored = sorted(self.ignored_fields.items())
            v = dict(vars(self))
        return [
            Metric("mlx_spec_requests_total", "counter", "HTTP generation requests by endpoint and outcome.",
                   [(f'{{endpoint="{e}",outcome="{o}"}}', n) for (e, o), n in requests]),
            Metric("mlx_spec_ignored_request_fields_total", "counter",
                   "Request fields accepted and ignored (clients' extra fields, as mlx-lm's server ignores them), by name "
                   f"(after {MAX_IGNORED_NAMES} names: other).",
                   [(f'{{field="{_label(f)}"}}', n) for f, n in ignored]),
            Metric("mlx_spec_prompt_tokens_total", "counter", "Prompt tokens processed.", [("", v["prompt_tokens"])]),
            Metric("mlx_spec_generation_tokens_total", "counter", "Tokens generated.", [("", v["generation_tokens"])]),
            Metric("mlx_spec_speculative_off_requests_total", "counter", "Requests that asked for plain decoding.",
                   [("", v["speculative_off_requests"])]),
            Metric("mlx_spec_speculative_fallback_requests_total", "counter",
                   "Requests whose drafter failed mid-way and finished with plain decoding.", [("", v["fallback_requests"])]),
            Metric("mlx_spec_speculative_startup_fallback", "gauge",
                   "1 when speculative decoding was configured but the drafter could not be attached.",
                   [("", v["startup_fallback"])]),
            Metric("mlx_spec_speculative_active", "gauge", "1 when a drafter is attached.", [("", v["speculative_active"])]),
            Metric("mlx_spec_batched_scheduling", "gauge", "1 when requests share decode steps, 0 when each decodes alone.",
                   [("", v["batching"])]),
            Metric("mlx_spec_decode_steps_total", "counter", "Decode steps (one target forward each, all rows of a batch).",
                   [("", v["decode_steps"])]),
            Metric("mlx_spec_decode_rows_total", "counter",
                   "Request rows over all decode steps (divided by the steps: mean rows per forward).", [("", v["decode_rows"])]),
            Metric("mlx_spec_prefill_seconds_total", "counter", "Seconds the generation thread spent feeding prompts.",
                   [("", round(v["prefill_seconds"], 6))]),
            Metric("mlx_spec_decode_seconds_total", "counter", "Seconds the generation thread spent in decode steps.",
                   [("", round(v["decode_seconds"], 6))]),
            Metric("mlx_spec_requests_running", "gauge", "Requests being prefilled or generated.", [("", v["running"])]),
            Metric("mlx_spec_requests_waiting", "gauge", "Requests queued.", [("", v["waiting"])]),
        ]


def _label(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(metrics: List[Metric]) -> str:
    """Prometheus text format."""
    lines: List[str] = []
    for m in metrics:
        lines.append(f"# HELP {m.name} {m.help}")
        lines.append(f"# TYPE {m.name} {m.kind}")
        lines.extend(f"{m.name}{labels} {value}" for labels, value in m.samples)
    return "\n".join(lines) + "\n"


def timings(prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float, spec: Optional[DecodeReport],
            cache_n: int = 0) -> Dict[str, Any]:
    """llama.cpp's per-request ``timings`` (draft_n, draft_n_accepted...) plus the round summary.

    ``spec``: the request's ``DecodeReport`` (``DecodeState.decode_report``), or None. ``cache_n``:
    prompt tokens reused from the prompt cache; as in llama.cpp, ``prompt_n`` counts the others
    (the tokens prefilled)."""
    prompt_n -= cache_n
    def per(n: int, s: float) -> Tuple[float, float]:
        return (round(1000 * s / n, 3) if n else 0.0), (round(n / s, 3) if s > 0 else 0.0)

    prompt_per_token, prompt_per_second = per(prompt_n, prompt_s)
    predicted_per_token, predicted_per_second = per(predicted_n, predicted_s)
    out = {
        "cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": round(1000 * prompt_s, 3),
        "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
        "predicted_n": predicted_n, "predicted_ms": round(1000 * predicted_s, 3),
        "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second,
        "draft_n": spec.draft_tokens if spec is not None else 0,
        "draft_n_accepted": spec.accepted_tokens if spec is not None else 0,
    }
    if spec is not None:
        out.update(draft_kind=spec.kind, draft_rounds=spec.rounds,
                   mean_acceptance_length=round(spec.mean_acceptance_length, 4),
                   acceptance_rate=round(spec.acceptance_rate, 4), draft_fallback=spec.fallback,
                   round_steps_ms={k: round(1e3 * v, 3) for k, v in spec.steps.items()},
                   draft_plain_steps=spec.plain_steps, draft_pause_reason=spec.pause_reason)
    return out
