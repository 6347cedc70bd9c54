"""Verifying a round: ONE ordinary forward of the target over [pending, *drafts] for every row.

Row b feeds its pending token, its k_b draft tokens and filler positions after them up to the
widest row (causal attention keeps filler out of the real rows; the transaction trims it like
rejected drafts). Rows that draft nothing this step feed their pending token alone: their token
comes from the same forward.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple, Union

import mlx.core as mx

from ..hooks.api import DecodeBatch
from .metrics import METRICS

Drafts = Union[List[int], mx.array]


def inputs(rows: Sequence, drafts: Sequence[Drafts], width: int, vocab_size: int) -> mx.array:
    """[B, width] verify inputs. Lazy draft arrays are clipped to the vocabulary, so that a faulty
    drafter cannot read outside the embedding (the round checks the drafts after the forward)."""
    if not any(isinstance(d, mx.array) for d in drafts):
        return mx.array([[r.pending, *d] + [r.pending] * (width - 1 - len(d)) for r, d in zip(rows, drafts)],
                        dtype=mx.uint32)
    return mx.stack([row_inputs(mx.array([row.pending], dtype=mx.uint32),
                                d if isinstance(d, mx.array) else mx.array(list(d), dtype=mx.uint32), width, vocab_size)
                     for row, d in zip(rows, drafts)])  # [B, width]


def row_inputs(first: mx.array, drafts: mx.array, width: int, vocab_size: int) -> mx.array:
    """One row's [width] inputs on the device: ``first`` [1] (the pending token), the drafts [k] clipped to the
    vocabulary, then ``first`` again as filler (also verifying ahead's, whose first token is still unread)."""
    body = drafts.astype(mx.uint32)
    if vocab_size:
        body = mx.minimum(body, vocab_size - 1)
    first = first.astype(mx.uint32)
    return mx.concatenate([first, body, mx.broadcast_to(first, (width - 1 - body.shape[0],))])


def verify(
    batch: DecodeBatch, drafts: Sequence[Drafts], vocab_size: int, width_for: Callable[[int], int] = lambda n: n,
) -> Tuple[mx.array, Dict[int, mx.array], mx.array]:
    """The target's logits over every row's block: ([B, W, V], tapped outputs {layer: [B, W, H]},
    the inputs [B, W]). ``width_for``: the verify width a cache policy wants for n positions."""
    width = width_for(1 + max(len(d) for d in drafts))
    fed = inputs(batch.rows, drafts, width, vocab_size)
    logits, captured = batch.forward(fed)
    METRICS.record_verify(sum(1 + len(d) for d in drafts), len(drafts) * width)
    return logits, captured, fed
