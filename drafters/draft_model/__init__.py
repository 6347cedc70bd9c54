"""``draft_model``: any mlx-lm causal LM with the target's tokenizer as drafter (mlx-lm's --draft-model)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ...plugin.types import Proposal
from ..base import Compatibility, DraftSession, Drafter, DrafterFamily, DraftTarget
from ..compat import check_tokenizer, check_vocab

DEFAULT_BLOCK_SIZE = 4  # 3 draft tokens, mlx-lm's default --num-draft-tokens
PREFILL_STEP = 2048


class DraftModelSession(DraftSession):
    def __init__(self, drafter: "DraftModelDrafter"):
        self.model = drafter.model
        self.cache = make_prompt_cache(self.model)
        self.fed = 0  # state.tokens[:fed] are in self.cache
        self._catch_up = 0
        self._round: List[int] = []  # what this round fed into self.cache, in order

    def caches(self) -> List[Any]:
        return self.cache

    def _feed(self, tokens: Union[List[int], mx.array]) -> mx.array:
        if isinstance(tokens, mx.array):  # one draft token, not yet evaluated
            return self.model(tokens.reshape(1, 1).astype(mx.uint32), cache=self.cache)[:, -1, :]
        logits = None
        for start in range(0, len(tokens), PREFILL_STEP):
            chunk = mx.array([tokens[start : start + PREFILL_STEP]], dtype=mx.uint32)
            logits = self.model(chunk, cache=self.cache)
        return logits[:, -1, :]  # [1, V]

    def propose(self, state: Any, max_drafts: int) -> Proposal:
        fresh = state.tokens[self.fed :]  # ends with the pending token
        self._catch_up = len(fresh)
        self._round = list(fresh)
        logits = self._feed(fresh)
        drafts: List[mx.array] = []  # [1] each, evaluated together: one sync per block
        history: List[int] = []  # the drafts as ints, only where logits processors read them
        qs: List[mx.array] = []
        while True:
            if state.sampling.greedy:
                token = mx.argmax(logits, axis=-1)  # [1]
            else:
                # q: the drafter's row after the target's processing (logits processors with the
                # same history, then the sampler's filters and temperature), drawn from the
                # drafter's own stream so that the target's stream never moves.
                logq = state.sampling.process(state.logprobs(logits[:, None], history, start=len(drafts)))  # [1, V]
                token = mx.random.categorical(logq, key=state.next_draft_key())  # [1]
                qs.append(logq)
            drafts.append(token)
            if state.logits_processors:
                history.append(int(token.item()))
            if len(drafts) == max_drafts:
                break
            logits = self._feed(token)
        q = mx.concatenate(qs, axis=0) if qs else None  # [k, V]
        tokens = mx.concatenate(drafts)
        mx.eval(tokens, q)
        drafted = [int(t) for t in tokens.tolist()]
        self._round.extend(drafted[:-1])
        return Proposal(drafted, q)

    def replay(self, n: int) -> None:
        """Feed this round's first n tokens again (the cache transaction restored the start first):
        how a recurrent draft model (e.g. Qwen3.5, Mamba) keeps part of a round."""
        self._feed(self._round[:n])

    def commit(self, state: Any, accepted: int, draft_tokens: int) -> int:
        # The cache holds the catch-up tokens and drafts[:k-1]; the accepted ones are now committed.
        kept_drafts = min(accepted, max(draft_tokens - 1, 0))
        self.fed += self._catch_up + kept_drafts
        return self._catch_up + kept_drafts


class DraftModelDrafter(Drafter):
    kind = "draft_model"
    family = "draft_model"
    default_block_size = DEFAULT_BLOCK_SIZE

    def __init__(self, model: nn.Module):
        self.model = model

    def new_session(self, state: Any) -> DraftSession:
        return DraftModelSession(self)


def detect(config: Dict[str, Any]) -> bool:
    """Any checkpoint mlx-lm can build is usable as a draft LM (lowest priority)."""
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
        return True
    except (ValueError, KeyError):
        return False


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    verdict = Compatibility()
    check_vocab(target.config, config, verdict)
    check_tokenizer(target.path, path, verdict)
    return verdict


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    from mlx_lm import load as mlx_load

    from ...plugin.commit import check_supported

    model, _ = mlx_load(str(path))
    check_supported(make_prompt_cache(model))
    return DraftModelDrafter(model)


family = DrafterFamily(
    name="draft_model",
    kind="draft_model",
    description="a small causal LM with the target's tokenizer proposes tokens one at a time",
    load=load,
    check=check,
    detect=detect,
    trainer=lambda: importlib.import_module(".train", __name__).DraftModelTrainer,  # mlx-spec train-drafter
    priority=-100,
)
