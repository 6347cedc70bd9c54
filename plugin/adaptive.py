"""Adaptive block size: shrink quickly when acceptance collapses, grow back slowly to the cap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class BlockSizeController:
    cap: int
    adaptive: bool = True
    floor: int = 2
    size: int = 0
    history: List[int] = field(default_factory=list)  # block size used by each round
    _streak: int = 0  # consecutive rounds that accepted most of their drafts

    def __post_init__(self) -> None:
        self.size = self.cap

    def next(self) -> int:
        self.history.append(self.size)
        return self.size

    def update(self, accepted: int, draft_tokens: int) -> None:
        if not self.adaptive or draft_tokens == 0:
            return
        if accepted == 0:
            # Each fully rejected round halves the block: a wasted verify costs ~B positions.
            self.size = max(self.floor, self.size // 2)
            self._streak = 0
        elif accepted * 4 >= draft_tokens * 3:
            self._streak += 1
            if self._streak >= 2 and self.size < self.cap:
                self.size = min(self.cap, self.size * 2 if accepted == draft_tokens else self.size + 1)
                self._streak = 0
        else:
            self._streak = 0
