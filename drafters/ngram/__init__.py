"""``ngram``: prompt lookup. No weights: propose what followed the most recent earlier occurrence
of the last n tokens of prompt + output (trying n, then n-1, down to 1).

Its whole state is the row's tokens, so the server's prompt cache keeps nothing of it: a row
restored from the cache drafts from ``row.tokens`` as any row (``DraftBatch.export_row`` and
``restore_row`` keep their defaults)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..base import Compatibility, DraftSession, Drafter, DrafterFamily, DraftTarget, Proposal

DEFAULT_BLOCK_SIZE = 8
DEFAULT_N = 3


def matched(tokens: Sequence[int], n: int, window: int = 4096) -> bool:
    """Whether the last ``n`` tokens occurred before, within the last ``window`` tokens (a full n-gram match)."""
    size = len(tokens)
    if n < 1 or size <= n:
        return False
    suffix = list(tokens[size - n :])
    return any(list(tokens[start : start + n]) == suffix for start in range(size - n - 1, max(-1, size - window - 1), -1))


def lookup(tokens: Sequence[int], n_max: int, k: int) -> List[int]:
    """k tokens that followed the most recent earlier match of the longest suffix (<= n_max).

    A continuation that reaches the end of ``tokens`` goes on with its own proposals, so a
    repeating pattern of period p < k still yields k tokens.
    """
    size = len(tokens)
    for n in range(min(n_max, size - 1), 0, -1):
        suffix = list(tokens[size - n :])
        for start in range(size - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[start + n + i])
                return seq[size:]
    return []


class NgramSession(DraftSession):
    def __init__(self, n: int):
        self.n = n

    def propose(self, state: Any, max_drafts: int) -> Proposal:
        return Proposal(lookup(state.tokens, self.n, max_drafts))

    def worth_probing(self, state: Any) -> bool:
        # A match of the full n: the text is repeating something (a 1-token match is nearly always there).
        return matched(state.tokens, self.n)


class NgramDrafter(Drafter):
    kind = "ngram"
    family = "ngram"
    default_block_size = DEFAULT_BLOCK_SIZE
    max_block_size = 16

    def __init__(self, n: int = DEFAULT_N):
        self.n = n

    def new_session(self, state: Any) -> DraftSession:
        return NgramSession(self.n)


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    return Compatibility(notes=["ngram: no weights, works with any target"])


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    return NgramDrafter(int(options.get("ngram_n", DEFAULT_N)))


family = DrafterFamily(
    name="ngram",
    kind="ngram",
    description="prompt lookup: propose what followed the latest earlier occurrence of the last n tokens",
    load=load,
    check=check,
    needs_weights=False,
)
