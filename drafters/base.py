"""What a drafter family provides. Built-in and third-party families implement the same classes.

A *family* is a checkpoint architecture (or a weightless rule) mapped to one *kind* (the round
loop it runs). A family module exposes a ``DrafterFamily`` object and registers it under the
entry-point group ``mlx_speculative.drafters``::

    [project.entry-points."mlx_speculative.drafters"]
    my_family = "my_package:family"
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from ..plugin.types import Proposal


class DrafterError(ValueError):
    """A drafter that cannot be used; the message names the field, the value and what was expected."""


@dataclass
class DraftTarget:
    """What a family may read of the target to check and attach a drafter."""

    config: Dict[str, Any]
    path: Optional[Path] = None
    model: Any = None  # the loaded mlx-lm model, when loading (None for config-only checks)
    tokenizer: Any = None
    num_layers: Optional[int] = None


@dataclass
class Compatibility:
    """A family's verdict on a drafter for a target, with one reason per checked field."""

    ok: bool = True
    reasons: List[str] = field(default_factory=list)  # why it is incompatible
    notes: List[str] = field(default_factory=list)  # what was checked and matched

    def fail(self, reason: str) -> None:
        self.ok = False
        self.reasons.append(reason)


class DraftSession(abc.ABC):
    """One request's drafting state (e.g. the drafter's own KV cache)."""

    @abc.abstractmethod
    def propose(self, state: Any, max_drafts: int) -> Proposal:
        """Up to ``max_drafts`` draft tokens to follow ``state.tokens`` (which end in the pending token)."""

    def caches(self) -> List[Any]:
        """The drafter's own caches; the round wraps them in a cache transaction."""
        return []

    def commit(self, state: Any, accepted: int, draft_tokens: int) -> int:
        """After verification: keep what matches the committed tokens.

        Returns how many of the positions this round wrote into ``caches()`` stay (the
        transaction then commits that many). Default: nothing of the drafter's caches stays.
        """
        return 0


class Drafter(abc.ABC):
    """A loaded drafter, shared by all requests on one target."""

    kind: str = ""
    family: str = ""
    default_block_size: int = 4

    def capture_layers(self) -> List[int]:
        """Target decoder layers whose outputs this drafter reads (0-based: layer i's output)."""
        return []

    @abc.abstractmethod
    def new_session(self, state: Any) -> DraftSession:
        """Per-request drafting state, made at the request's first decode step."""


@dataclass
class DrafterFamily:
    """A registered family. ``detect`` decides from config.json alone whether a checkpoint is one."""

    name: str
    kind: str
    description: str
    load: Callable[[Optional[Path], Dict[str, Any], DraftTarget, Dict[str, Any]], Drafter]
    check: Callable[[Optional[Path], Dict[str, Any], DraftTarget], Compatibility]
    detect: Callable[[Dict[str, Any]], bool] = lambda config: False
    needs_weights: bool = True
    # Higher wins when several families detect the same config (generic draft LMs are lowest).
    priority: int = 0
    distribution: str = ""  # filled by the registry: the package it came from
    trainer: Optional[Callable[[], Any]] = None  # the family's FamilyTrainer class (drafters/training), lazily
