"""The server's warm-up: batches of 1 .. N rows decoded once before the first client is served.

Why: a backend that compiles per shape (MLX-CUDA: mx.compile traces, fused kernels, the plugin's kernel
templates) pays seconds the first time a batch of a new row count decodes (measured on an H100 through
bench/server_batching.py: 4 clients after 1 gave 97 tok/s plain and 29 tok/s speculative over 10 s, rounds
of 366 ms while shapes compiled). vLLM captures its CUDA graphs for each batch size at start-up for the same
reason. Each warm-up batch runs through the scheduler and every plugin like a served one (prefill, rows
joining and leaving, rounds and plain steps), on a scheduler of its own with no prompt cache, and leaves
nothing behind but compiled shapes and the plugins' measured costs.

Shapes also change with the key length: a batch's cache spans a multiple of the backend's ``bucket`` past its
longest row (plugin/cuda/ragged_cache.py), and each span is a new shape for every row count. So each row count is
decoded once per bucket up to ``server.warmup_tokens`` keys, its first row's prompt ending just below the
bucket's end (the others stay short: only the longest row sets the span), the decode crossing into the next.
Without that the served 256-word bench met its 512..1280-key spans as stalls of seconds (every row count).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from .host import GenerationParams, Host
from .scheduler import Request, Scheduler
from .state import WARMUP_CONTINUATION, LoadedTarget

log = logging.getLogger("mlx_speculative.server")
TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n\nThe quick brown fox jumps over the lazy dog. ")
PROMPT_TOKENS = 48  # the first row's prompt; row i's is 5 * i longer (rows at their own lengths, as served)
NEW_TOKENS = 64  # per row: a few rounds of a 16-position block, and plain steps where a pause begins
SPAN_TOKENS = 32  # per row, at each longer span: a bucket's end crossed
DEFAULT_TOKENS = 2048  # ``server.warmup_tokens`` left out: spans up to 2048 keys
CONTINUATION_EXTRA = 32  # tokens past a request's last: blocks (up to 33 positions) drafted near its end


def default_rows(max_active: int) -> int:
    """``server.warmup_rows`` left out: every row count the server can form on a CUDA backend, else none
    (CPUs and Metal compile little per shape)."""
    cuda = getattr(mx, "cuda", None)
    try:
        on_cuda = bool(cuda is not None and cuda.is_available()) and mx.default_device() == mx.gpu
    except Exception:  # noqa: BLE001 - an MLX without the query: no warm-up
        on_cuda = False
    return max_active if on_cuda else 0


def text_ids(target: LoadedTarget) -> List[int]:
    """TEXT's tokens (ids spread over the vocabulary where the target has no tokenizer); prompts repeat them."""
    if target.tokenizer is not None:
        ids = list(target.tokenizer.encode(TEXT))
    else:
        vocab = int(target.model_config.get("vocab_size", 256))
        ids = [(3 + 7919 * i) % vocab for i in range(97)]
    if not ids:
        raise ValueError("the tokenizer encodes the warm-up text to no tokens")
    return ids


def first_rows(target: LoadedTarget, tokens: int) -> List[Tuple[int, int]]:
    """(prompt length, new tokens) of a warm-up batch's first row: short, then just below each bucket's end up
    to ``tokens`` keys (and the model's context); one short case where the cache policy has no buckets."""
    bucket = target.cache_policy.bucket
    context = int(target.model_config.get("max_position_embeddings") or 0) or tokens
    cases = [(PROMPT_TOKENS, NEW_TOKENS)]
    if bucket is not None and bucket > SPAN_TOKENS:
        end = min(tokens, context)
        cases += [(b - SPAN_TOKENS // 2, SPAN_TOKENS) for b in range(bucket, end - SPAN_TOKENS // 2 + 1, bucket)]
    return cases


def warm_up(host: Host, target: LoadedTarget, rows: int, batching: bool = True, tokens: Optional[int] = None,
            prefill_step_size: Optional[int] = None) -> float:
    """Decode batches of 1 .. ``rows`` rows (greedy) at each of ``first_rows`` (``tokens`` None: DEFAULT_TOKENS);
    returns the seconds it took."""
    t0 = time.perf_counter()
    scheduler = Scheduler(host, target, batching=batching, raise_errors=True, prompt_cache=None)
    planned = batches(target, rows, tokens)
    continuations = _continuations(host, target, planned)
    for prompts, new_tokens in planned:
        batch: List[Request] = []
        for p in prompts:
            params = GenerationParams(max_tokens=new_tokens, stop_token_ids=[],
                                      options={WARMUP_CONTINUATION: continuations[tuple(p)]})
            if prefill_step_size:
                params.prefill_step_size = prefill_step_size
            batch.append(scheduler.submit(p, params))
        while not all(r.done for r in batch):
            scheduler.step()
    mx.clear_cache()
    seconds = time.perf_counter() - t0
    if rows:
        log.info("warmed up: batches of 1..%d rows, %d key spans, in %.1f s", rows, len(planned) // rows, seconds)
    return seconds


def _continuations(host: Host, target: LoadedTarget, planned: List[Tuple[List[List[int]], int]]
                   ) -> Dict[Tuple[int, ...], List[int]]:
    """Each warm-up prompt's greedy continuation by the target alone (plain steps), a block past its warm-up tokens."""
    need: Dict[Tuple[int, ...], int] = {}
    for prompts, new_tokens in planned:
        for p in prompts:
            need[tuple(p)] = max(need.get(tuple(p), 0), new_tokens + CONTINUATION_EXTRA)
    params = lambda n: GenerationParams(max_tokens=n, stop_token_ids=[], options={"speculative": False})  # noqa: E731
    return {p: list(host.generate(target, list(p), params(n)).tokens) for p, n in need.items()}


def batches(target: LoadedTarget, rows: int, tokens: Optional[int] = None) -> List[Tuple[List[List[int]], int]]:
    """The warm-up's batches in order: (each row's prompt, new tokens a row) for 1 .. ``rows`` rows at each of
    ``first_rows``."""
    cases = first_rows(target, DEFAULT_TOKENS if tokens is None else tokens)
    ids = text_ids(target)
    out = []
    for n in range(1, rows + 1):
        for first, new_tokens in cases:
            lengths = [first] + [PROMPT_TOKENS + 5 * i for i in range(1, n)]
            out.append(([(ids * (length // len(ids) + 1))[:length] for length in lengths], new_tokens))
    return out
