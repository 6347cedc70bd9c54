"""Drafter training in MLX (``mlx-spec train-drafter``): a family-agnostic core.

The core turns text into the target's own continuations, runs the target's ordinary forward with
the family's layers tapped, and trains the family's objective with AdamW (warmup + cosine),
gradient clipping, held-out tau, checkpoints in the family's real format and exact resume.
Families plug in through ``DrafterFamily.trainer`` (see ``spec.FamilyTrainer``).
"""

from .checks import trainable_kinds
from .loop import evaluate, load_target, train
from .spec import Batch, FamilyTrainer, TrainOptions, TrainTarget

__all__ = ["Batch", "FamilyTrainer", "TrainOptions", "TrainTarget", "evaluate", "load_target", "train", "trainable_kinds"]
