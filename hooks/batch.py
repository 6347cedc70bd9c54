"""A persistent batch of requests of one target: one forward of the target per decode step for all rows.

Rows join after their own prefill (their ``KVCache`` is merged into the batch's ``BatchKVCache``,
mlx-lm's left-padded batch cache) and leave when they finish (``BatchKVCache.filter``). The batch
owns the caches: a joined row's ``state.cache`` is empty and every forward of its tokens goes
through ``DecodeBatch.forward``. A decode step of the batch is ``host_decode_batch`` (hooks.specs):
a plugin's batched round, or the host's own one-token step for every row (``plain_step``).

Only targets whose caches are all ``KVCache`` batch (``refusal``): positions are a prefix of an
array, so rows of different lengths are left padding and per-row commits are exact. Everything
else (rotating windows, recurrent state, the padded shape-stable caches) keeps per-request caches.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from . import taps
from .state import DecodeState, GeneratedToken, LoadedTarget, StepOutput


def cache_refusal(target: LoadedTarget) -> Optional[str]:
    """Why the host cannot keep ``target``'s requests in one batch cache, or None when it can."""
    if "cache_factory" in target.attachments:
        return "the target uses per-request shape-stable padded caches (plugin/padded_cache.py)"
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(target.model)})
    if kinds != ["KVCache"]:
        return (f"the target's caches are {', '.join(kinds)}; batched decoding keeps rows in a BatchKVCache, "
                "which holds plain KVCache layers only")
    return None


class DecodeBatch:
    """The rows (``DecodeState``s of one target) decoded together, and their batch caches."""

    def __init__(self, target: LoadedTarget):
        self.target = target
        self.rows: List[DecodeState] = []
        self.cache: Optional[List[BatchKVCache]] = None  # one per layer, [B] rows; None while empty

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, state: DecodeState) -> None:
        """Add a prefilled row (its caches hold every token but ``pending``); its caches move into the batch."""
        if state.target is not self.target:
            raise ValueError("a row of another target cannot join this batch")
        kinds = sorted({type(c).__name__ for c in state.cache})
        if kinds != ["KVCache"]:
            raise ValueError(f"a row joining a batch needs KVCache layers; got {', '.join(kinds) or 'no cache'}")
        merged = [BatchKVCache.merge([c]) for c in state.cache]
        if self.cache is None:
            self.cache = merged
        else:
            for mine, theirs in zip(self.cache, merged):
                mine.extend(theirs)
        state.cache = []  # the batch owns the row's positions now
        self.rows.append(state)

    def leave(self, state: DecodeState) -> None:
        """Drop a row and its positions (a finished or cancelled request)."""
        i = next((j for j, s in enumerate(self.rows) if s is state), None)
        if i is None:
            return
        del self.rows[i]
        if not self.rows:
            self.cache = None
            return
        keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
        for c in self.cache or []:
            c.filter(keep)

    def compact(self, at_least: int = 16) -> int:
        """Drop the left padding every row shares (at least ``at_least`` positions): returns how many.

        Ragged commits pad each row by what it rejects while the batch keeps the longest row's
        positions, so padding common to all rows builds up; it is never read (masked) but costs
        attention work and memory.
        """
        if self.cache is None:
            return 0
        pad = int(mx.min(self.cache[0].left_padding).item())
        if pad < at_least:
            return 0
        for c in self.cache:
            c.keys, c.values = c.keys[..., pad:, :], c.values[..., pad:, :]
            c._idx -= pad
            c.left_padding = c.left_padding - pad
        return pad

    def forward(self, inputs: Sequence[Sequence[int]]) -> mx.array:
        """The target's ordinary forward over one token list per row (equal lengths): logits [B, W, V].

        Each row's ``last_captures`` gets its own slice ``[1, W, H]`` of the layers it records.
        """
        if len(inputs) != len(self.rows) or len({len(r) for r in inputs}) != 1:
            raise ValueError(f"expected {len(self.rows)} token lists of one length; got lengths {[len(r) for r in inputs]}")
        layers = sorted({i for s in self.rows for i in s.capture_layers})
        with taps.record(layers) as rec:
            logits = self.target.model(mx.array([list(r) for r in inputs], dtype=mx.uint32), cache=self.cache)
        recorded = {i: mx.concatenate(v, axis=1) if len(v) > 1 else v[0] for i, v in rec.items() if v}  # [B, W, H]
        for b, s in enumerate(self.rows):
            s.last_captures = {i: h[b : b + 1] for i, h in recorded.items() if i in s.capture_layers}
        return logits

    def plain_step(self) -> List[StepOutput]:
        """The host's one-token step for every row: feed each pending token, apply its processors, sample."""
        logits = self.forward([[s.pending] for s in self.rows])  # [B, 1, V]
        logprobs, sampled = [], []
        for b, s in enumerate(self.rows):
            s.keep_captures(1)
            lp = s.logprobs(logits[b : b + 1, -1:])  # [1, V]
            logprobs.append(lp)
            sampled.append(s.sampler(lp))
        mx.eval(sampled, logprobs, [list(s.captures.values()) for s in self.rows])  # captures: see Host._plain_step
        out = []
        for s, t, lp in zip(self.rows, sampled, logprobs):
            gen = GeneratedToken(int(t.item()), lp[0])
            s.tokens.append(gen.token)
            s.pending_logprobs = gen.logprobs
            out.append(StepOutput([gen]))
        return out


class RowEvents:
    """Stop and length handling plus streaming text of one row, as ``Host.stream`` does for one request."""

    def __init__(self, target: LoadedTarget, max_tokens: int, stop_token_ids: Optional[Sequence[int]] = None):
        self.stop = set(stop_token_ids if stop_token_ids is not None else target.tokenizer.eos_token_ids)
        self.detok = target.tokenizer.detokenizer
        self.detok.reset()
        self.max_tokens = max_tokens
        self.emitted = 0

    def event(self, gen: GeneratedToken) -> Any:
        """The ``HostEvent`` of one generated token; ``finish_reason`` set ends the row."""
        from .host import HostEvent

        if gen.token in self.stop:
            self.detok.finalize()
            return HostEvent(gen.token, self.detok.last_segment, gen.logprobs, "stop")
        self.emitted += 1
        self.detok.add_token(gen.token)
        if self.emitted >= self.max_tokens:
            self.detok.finalize()
            return HostEvent(gen.token, self.detok.last_segment, gen.logprobs, "length")
        return HostEvent(gen.token, self.detok.last_segment, gen.logprobs)

