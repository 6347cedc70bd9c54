"""Verifying a round: ONE ordinary forward of the target over [pending, *drafts]."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from .padded_cache import verify_width


def verify(state: Any, drafts: Sequence[int]) -> mx.array:
    """The target's processed log-probabilities after each verified position: [k+1, V].

    Row i is the distribution of the token after ``drafts[:i]`` (row 0: after the pending token),
    with the logits processors applied per row as one-token decoding would. The forward runs on
    the target's own caches; the caller wraps it in a cache transaction.
    """
    fed = [state.pending, *drafts]
    # Shape-stable caches want a few query widths only: pad with filler positions after the real
    # ones (causal attention keeps them out of the real rows; the transaction trims them).
    width = verify_width(state.cache, len(fed))
    logits = state.forward(fed + [state.pending] * (width - len(fed)))[:, : len(fed)]  # [1, k+1, V]
    logprobs = state.logprobs(logits, drafts)  # [k+1, V]
    mx.eval(logprobs)
    return logprobs
