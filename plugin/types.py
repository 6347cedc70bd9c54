"""The small dataclasses that drafters (proposers), the verifier/acceptance and metrics share.

Terms, used everywhere in this project:
- **round**: draft a block, verify it with one ordinary forward of the target, accept, commit.
- **block size B**: positions verified per round: the pending token plus up to B-1 draft tokens.
- **draft tokens**: the drafter's proposals in a round (k <= B-1 of them).
- **accepted**: draft tokens the target agrees with (greedy: equal to its argmax; sampling: kept
  by rejection sampling, or equal to its sample under ``acceptance: exact``).
- **bonus**: the one target token emitted after the accepted prefix (the correction at the first
  rejection, or the next token after a fully accepted block). A round emits accepted + 1 tokens.
- **mean acceptance length** tau = tokens emitted per round = 1 + accepted / rounds (includes the bonus).
- **acceptance rate** = accepted / draft tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union

import mlx.core as mx


@dataclass
class Proposal:
    """A drafter's proposal for one round."""

    # The k draft tokens: ints, or a [k] integer array that may still be unevaluated (the round
    # then queues its verify behind the drafter's kernels and checks the tokens afterwards).
    tokens: Union[List[int], mx.array]
    # [k, V] log-probabilities the tokens were drawn from (q in the papers); None = one-hot q.
    logprobs: Optional[mx.array] = None


@dataclass
class RoundOutcome:
    """What verification decided for one round."""

    draft_tokens: int  # k, proposals verified
    accepted: int  # a, leading draft tokens kept (0 <= a <= k)
    tokens: List[int] = field(default_factory=list)  # the a accepted tokens plus the bonus

    @property
    def emitted(self) -> int:
        return self.accepted + 1
