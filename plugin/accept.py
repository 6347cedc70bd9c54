"""Acceptance: which draft tokens a round keeps, and the bonus token. Pure functions.

Notation of Leviathan et al. 2023 / Chen et al. 2023: p is the target's distribution at a
position (after temperature, top-k/top-p/min-p and logits processors, as one-token decoding
applies them), q the drafter's; x_1..x_k the draft tokens.
"""

from __future__ import annotations

from typing import Callable, Tuple

import mlx.core as mx


def leading_matches(drafts: mx.array, target: mx.array) -> int:
    """Length of the longest prefix where drafts[i] == target[i]. drafts, target: [k]."""
    if drafts.size == 0:
        return 0
    hits = (drafts == target).astype(mx.int32)  # [k]
    return int(mx.cumprod(hits).sum().item())


def greedy_accept(drafts: mx.array, target_logprobs: mx.array) -> Tuple[int, int]:
    """Temperature 0: keep drafts while they equal argmax p; the bonus is argmax p after them.

    drafts: [k]; target_logprobs: [k+1, V]. Returns (accepted, bonus token).
    """
    target = mx.argmax(target_logprobs, axis=-1)  # [k+1]
    a = leading_matches(drafts, target[: drafts.size])
    return a, int(target[a].item())


def exact_accept(
    drafts: mx.array, target_logprobs: mx.array, sampler: Callable[[mx.array], mx.array]
) -> Tuple[int, int]:
    """mlx-lm's rule: sample y_i ~ p_i at every position, keep drafts while x_i == y_i.

    Each emitted token is a sample of p given the tokens before it, so the output distribution
    is the target's; acceptance is low at temperature > 0 (see ``rejection_accept``).
    """
    target = sampler(target_logprobs)  # [k+1]
    a = leading_matches(drafts, target[: drafts.size])
    return a, int(target[a].item())
