"""``mtp``: multi-token-prediction drafters that come with their target.

Families (each registered under ``mlx_speculative.drafters`` in pyproject.toml):

- ``qwen3_5_mtp`` (``qwen.py``): the Qwen3.5 / Qwen3.6 / Qwen3-Next ``mtp.*`` head, inside the
  target's checkpoint or split out by mlx-vlm; one full-attention layer with its own KV cache
  (``batch.HeadBatch``). Also a head of that kind trained for a plain target (llama, qwen3, ...).
- ``gemma4_assistant`` (``gemma.py``): Google's Gemma 4 assistant; no cache of its own, it attends
  over the K/V of the target's last full- and sliding-attention layers (``assistant.AssistantBatch``).
- ``deepseek_nextn`` (``deepseek.py``): DeepSeek-V3's nextn layer ``model.layers.{num_hidden_layers}``
  inside the target's checkpoint; a decoder block with its own KV cache (``batch.HeadBatch``).

Every family reads the target's final hidden state AFTER its final norm (the host taps the last
decoder layer; the drafter applies the target's own norm). Block size: the checkpoint's depth by
default; a larger block applies the head recursively, per row only while its recursive drafts get
accepted (``batch.Depth``).
"""

from __future__ import annotations

import importlib

from ..base import DrafterFamily
from . import deepseek, gemma, qwen

KIND = "mtp"


def _trainer():  # type: ignore[no-untyped-def]
    return importlib.import_module(".train", __name__).MTPTrainer


qwen_family = DrafterFamily(
    name=qwen.FAMILY,
    kind=KIND,
    description="Qwen3.5 / Qwen3.6 / Qwen3-Next MTP head (mtp.* in the target's checkpoint, or split out by mlx-vlm; "
                "or trained for a plain target)",
    load=qwen.load,
    check=qwen.check,
    detect=qwen.detect,
    trainer=_trainer,  # mlx-spec train-drafter --kind mtp
    priority=20,
    in_target=qwen.IN_TARGET,
)

gemma_family = DrafterFamily(
    name=gemma.FAMILY,
    kind=KIND,
    description="Gemma 4 assistant (gemma4_assistant): attends over the target's own K/V, dense or centroid-routed head",
    load=gemma.load,
    check=gemma.check,
    detect=gemma.detect,
    trainer=_trainer,
    priority=20,
)

deepseek_family = DrafterFamily(
    name=deepseek.FAMILY,
    kind=KIND,
    description="DeepSeek-V3 nextn layer (model.layers.{num_hidden_layers} in the target's checkpoint)",
    load=deepseek.load,
    check=deepseek.check,
    detect=deepseek.detect,
    priority=20,
    in_target=deepseek.IN_TARGET,
)
