"""A bigram-table drafter: proposes argmax next tokens from a [V, V] score table."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from mlx_speculative.drafters.base import Compatibility, DraftSession, Drafter, DrafterFamily, DraftTarget, Proposal
from mlx_speculative.drafters.compat import check_vocab

MODEL_TYPE = "bigram_drafter"


class BigramSession(DraftSession):
    def __init__(self, table: mx.array):
        self.table = table

    def propose(self, state: Any, max_drafts: int) -> Proposal:
        drafts: List[int] = []
        token = state.pending
        for _ in range(max_drafts):
            token = int(mx.argmax(self.table[token]).item())
            drafts.append(token)
        return Proposal(drafts)


class BigramDrafter(Drafter):
    kind = "bigram"
    family = "bigram"
    default_block_size = 4

    def __init__(self, table: mx.array):
        self.table = table  # [V, V]

    def new_session(self, state: Any) -> DraftSession:
        return BigramSession(self.table)


def detect(config: Dict[str, Any]) -> bool:
    return config.get("model_type") == MODEL_TYPE


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    verdict = Compatibility()
    check_vocab(target.config, config, verdict)
    return verdict


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    weights = mx.load(str(Path(path) / "model.safetensors"))
    if "bigram.weight" not in weights:
        raise ValueError(f"{path}: expected tensor 'bigram.weight' [V, V], found {sorted(weights)}")
    return BigramDrafter(weights["bigram.weight"])


family = DrafterFamily(
    name="bigram",
    kind="bigram",
    description="example third-party family: a bigram score table",
    load=load,
    check=check,
    detect=detect,
    priority=10,
)
