"""What the training core and a drafter family's trainer exchange.

A family makes itself trainable by setting ``DrafterFamily.trainer`` to a callable returning a
``FamilyTrainer`` subclass (imported lazily, from the family's own folder, e.g.
``drafters/dflash/train.py``). The core owns everything else: data, the target's forward and
captures, batches, the optimiser and schedule, evaluation, checkpoints and resume.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...hooks.api import loading


EVAL_LOGITS = 1 << 26  # logits (elements) one evaluation forward may make


@dataclass
class TrainOptions:
    """One training run (``mlx-spec train-drafter``'s options; field = option name with dashes)."""

    target: str
    kind: str
    out: str
    data: List[str] = field(default_factory=list)
    heldout: List[str] = field(default_factory=list)
    glob: str = "*"
    init: Optional[str] = None
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 256
    prompt_tokens: int = 64
    sequences: Optional[int] = None  # default: steps x batch_size, at most the prompts available
    heldout_sequences: int = 16
    temperature: float = 0.0
    lr: float = 6e-4
    warmup: Optional[int] = None  # default: 5% of the steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    block_size: Optional[int] = None  # default: the family's
    num_layers: Optional[int] = None
    # Family-specific (a family lists the ones it reads in FamilyTrainer.family_options).
    hidden_size: Optional[int] = None
    target_layers: Optional[List[int]] = None
    mask_token_id: Optional[int] = None
    anchors: Optional[int] = None
    loss_decay_gamma: Optional[float] = None
    kl_weight: Optional[float] = None
    draft_vocab_size: Optional[int] = None
    eval_every: int = 100
    checkpoint_every: int = 100
    log_every: int = 10
    gen_batch: int = 64
    dtype: Optional[str] = None  # of the written checkpoint; default the target's
    seed: int = 0
    resume: bool = False
    max_time: Optional[float] = None  # seconds; then stop, checkpoint, and let --resume continue


# Options that change neither the data nor the weights: a resumed run may change them.
NOT_RUN_DEFINING = ("out", "resume", "eval_every", "checkpoint_every", "log_every", "gen_batch", "max_time", "dtype")
FAMILY_OPTIONS = ("hidden_size", "target_layers", "mask_token_id", "anchors", "loss_decay_gamma", "kl_weight",
                  "draft_vocab_size")


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class TrainTarget:
    """The loaded target, as the family trainers see it."""

    model: nn.Module
    tokenizer: Any
    path: Path
    config: Dict[str, Any]
    num_layers: int
    dtype: mx.Dtype  # of its (dequantized) weights


@dataclass
class Batch:
    """Training sequences: a prompt from the text, then the target's own continuation."""

    tokens: mx.array  # [b, L] uint32
    first: int  # the prompt's last position: every token after it is the target's
    features: Optional[mx.array] = None  # [b, L, F] from the target's forward (families with captures)
    logits: Optional[mx.array] = None  # [b, L, V] the target's (families with needs_logits)
    anchors: Optional[np.ndarray] = None  # [b, n] block starts (first <= p <= L - block_size)


class FamilyTrainer(abc.ABC):
    """A family's objective, drafter construction and checkpoint writer."""

    kind: str = ""
    default_block_size: int = 4
    family_options: Tuple[str, ...] = ()  # which of FAMILY_OPTIONS this family reads
    needs_logits: bool = False

    def __init__(self, options: TrainOptions):
        self.options = options

    @classmethod
    def check_options(cls, options: TrainOptions) -> None:
        """Refuse options that depend on nothing loaded (raise ValueError, one line)."""
        for name in FAMILY_OPTIONS:
            if getattr(options, name) is not None and name not in cls.family_options:
                raise ValueError(f"{option_name(name)} does not apply to --kind {cls.kind}")

    @property
    def block_size(self) -> int:
        return int(self.options.block_size or self.default_block_size)

    def init_checkpoint(self, detect: Optional[Any] = None, not_this: str = "") -> Tuple[Path, Dict[str, Any]]:
        """(folder, config.json) of ``--init``: a float checkpoint, of this family when ``detect`` is given
        (``not_this`` completes the refusal: "--init: 'x' <not_this>")."""
        o = self.options
        path = loading.resolve_path(o.init, "--init drafter")
        config = loading.read_config(path, "--init drafter")
        if detect is not None and not detect(config):
            raise ValueError(f"--init: {o.init!r} {not_this}")
        if "quantization" in config:
            raise ValueError(f"--init: {o.init!r} is quantized; training needs float weights")
        return path, config

    @abc.abstractmethod
    def build(self, target: TrainTarget) -> nn.Module:
        """The trainable drafter (float32), new or from ``options.init``."""

    def capture_layers(self) -> List[int]:
        """Target decoder layers whose outputs ``features`` reads."""
        return []

    def features(self, target: TrainTarget, captures: Dict[int, mx.array]) -> Optional[mx.array]:
        """[b, L, F] drafter input features from the captured layer outputs (each [b, L, H])."""
        return None

    def data_ready(self, sequences: np.ndarray, first: int) -> None:
        """The run's training sequences ([N, L], positions after ``first`` the target's) exist: called
        once after ``build`` (a fresh or a resumed run alike), e.g. to choose a vocabulary from them."""

    def sample_anchors(self, rng: np.random.Generator, length: int, first: int, rows: int) -> Optional[np.ndarray]:
        """[rows, n] anchor positions for one training step (None: the objective uses every position)."""
        return None

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> mx.array:
        """Scalar training loss (differentiated with respect to ``model``'s parameters)."""

    @abc.abstractmethod
    def draft(self, model: nn.Module, batch: Batch) -> mx.array:
        """[b, n, block_size - 1] greedy draft tokens of a round whose pending token sits at each
        of ``batch.anchors`` (context: the positions before it)."""

    def anchors_per_forward(self, rows: int, vocab: int) -> int:
        """Anchors per ``draft`` call in the held-out evaluation: [rows, n, B-1, vocab] logits
        within EVAL_LOGITS elements by default."""
        return max(1, EVAL_LOGITS // (rows * max(1, self.block_size - 1) * vocab))

    @abc.abstractmethod
    def save(self, model: nn.Module, out_dir: Path, target: TrainTarget, dtype: mx.Dtype) -> List[str]:
        """Write the drafter in the family's real checkpoint format; returns the file names."""

    def describe(self) -> str:
        return f"{self.kind} drafter, block size {self.block_size}"
