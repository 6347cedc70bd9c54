"""Training MTP drafters (``mlx-spec train-drafter --kind mtp``): a Qwen3.5 / Qwen3-Next head for a
qwen3_5 or qwen3_next target, a Gemma 4 assistant for a gemma4 target (from ``--init``, or new), or a
Qwen3.5-style head for any other plain mlx-lm decoder (llama, qwen3, ...: ``qwen.plain_head_config``,
recording ``target_model_type``).

Both objectives unroll the drafter for the block's B-1 draft steps over every position at once, as
decoding chains it: step 1 reads the target's final hidden state (after its final norm), step s > 1
the drafter's own output of step s-1 and the target's token (teacher forcing: while the drafts match,
they are these tokens, so the accepted prefixes, all that tau counts, are the same). Cross-entropy on
the target's own tokens after the prompt, every step weighted alike.

- Qwen head (``objectives.head_steps``): entry (token t+1, hidden t) at position t with its own KV
  cache; step s at index i sits at position i + s - 1 and attends to the step-1 entries <= i, to its
  own chain's earlier steps, and to itself: what its cache holds when decoding.
- Gemma assistant (``objectives.assistant_steps``): the query for a pending token at p sits at p for
  every step and attends to the target's K/V at positions < p (sliding layers: within the window).
  Those K/V are the target's own layers' (the captured input of its last full- and sliding-attention
  layers fed through those layers). The sparse head's centroids learn the cluster of the target's
  token by a second cross-entropy; its drafts (``draft``) go through the sparse head as decoding does.

Checkpoints: the Qwen head in mlx-vlm's standalone layout (``model_type: qwen3_5_mtp``), the
assistant in Google's ``gemma4_assistant`` layout, each with its block size and the target's tokenizer.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoint import copy_tokenizer, read_tensors
from ..compat import config_value
from ..training.spec import Batch, FamilyTrainer, TrainOptions, TrainTarget
from . import gemma, objectives, qwen
from . import target as tg
from .gemma4_assistant import Model as Assistant
from .gemma4_assistant import ModelArgs as AssistantArgs
from .qwen3_5_mtp import QWEN3_5_TYPES, QWEN3_NEXT_TYPES
from .qwen3_5_mtp import Model as Head
from .qwen3_5_mtp import ModelArgs as HeadArgs
from .qwen3_5_mtp import text_config

DEFAULT_BLOCK_SIZE = 4  # 3 draft steps


def new_assistant_config(target: TrainTarget, hidden: Optional[int], layers: Optional[int]) -> Dict[str, Any]:
    """An assistant for ``target`` in the layout of google/gemma-4-*-assistant: its sliding layers then one
    full one, the target's head dims, window and RoPE; the sparse head where the vocabulary is large."""
    ta = gemma._target_args(target.config)
    n = layers or 4
    width = hidden or max(32, ta.hidden_size // 4)
    vocab = int(ta.vocab_size)
    ordered = vocab >= 65536 and vocab % 2048 == 0
    text = {"model_type": "gemma4_text", "hidden_size": width, "intermediate_size": 4 * width, "num_hidden_layers": n,
            "num_attention_heads": ta.num_attention_heads, "num_key_value_heads": ta.num_key_value_heads,
            "head_dim": ta.head_dim, "global_head_dim": ta.global_head_dim, "sliding_window": ta.sliding_window,
            "layer_types": ["sliding_attention"] * (n - 1) + ["full_attention"], "num_kv_shared_layers": n,
            "rope_parameters": copy.deepcopy(ta.rope_parameters), "vocab_size": vocab, "rms_norm_eps": ta.rms_norm_eps,
            "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "tie_word_embeddings": True,
            "hidden_size_per_layer_input": 0, "use_double_wide_mlp": False, "max_position_embeddings": ta.max_position_embeddings}
    return {"architectures": ["Gemma4AssistantForCausalLM"], "backbone_hidden_size": ta.hidden_size,
            "centroid_intermediate_top_k": 32, "model_type": "gemma4_assistant", "num_centroids": 2048,
            "text_config": text, "tie_word_embeddings": True, "use_ordered_embeddings": ordered}


class MTPTrainer(FamilyTrainer):
    kind = "mtp"
    default_block_size = DEFAULT_BLOCK_SIZE
    family_options = ("hidden_size",)

    def __init__(self, options: TrainOptions):
        super().__init__(options)
        self.config: Dict[str, Any] = {}
        self.style = ""  # "head" (Qwen) or "assistant" (Gemma 4)

    def build(self, target: TrainTarget) -> nn.Module:
        o = self.options
        t_type = str(text_config(target.config).get("model_type", target.config.get("model_type", "")))
        raw: Optional[Dict[str, mx.array]] = None
        if o.init is not None:
            path, config = self.init_checkpoint()
            if gemma.detect(config):
                self.style = "assistant"
            elif qwen.detect(config):
                self.style = "head"
                standalone = qwen.is_standalone(config)
                names = qwen._mtp_names(path, standalone)
                if not names:
                    raise ValueError(f"--init: {o.init!r} has no MTP head tensors (mtp.*)")
                hf = not standalone and tg.file_format(tg.headers(path)[names[0]].file) != "mlx"
                raw = Head.sanitize(tg.read_tensors(path, names), hf_layout=hf)
                config = self._head_config(text_config(config), config.get(qwen.TARGET_FIELD))
            else:
                raise ValueError(f"--init: {o.init!r} is neither a gemma4_assistant nor a Qwen3.5/Qwen3-Next MTP head")
            if raw is None:
                raw = read_tensors(path)
        elif t_type.startswith("gemma4"):
            self.style, config = "assistant", new_assistant_config(target, o.hidden_size, o.num_layers)
        elif t_type.startswith("deepseek"):
            raise ValueError(f"--kind mtp: the target's model_type is {t_type!r}; DeepSeek nextn layers are not trained "
                             "here (allowed: qwen3_5, qwen3_next, gemma4 and plain decoders such as llama, qwen3)")
        else:
            if o.hidden_size is not None or o.num_layers is not None:
                raise ValueError("--hidden-size / --num-layers: a Qwen MTP head has the target's width and one layer")
            if t_type in QWEN3_5_TYPES + QWEN3_NEXT_TYPES:
                config = self._head_config(text_config(target.config))
            else:  # a plain decoder: a new qwen3_5-style head that names its target's type
                for part in (tg.embedding, tg.final_norm, tg.lm_head):
                    part(target.model)  # what the head reads of the target, or a clear error
                config = qwen.plain_head_config(target.config, self.block_size)
            self.style = "head"
        check = (gemma if self.style == "assistant" else qwen).check
        from ..base import DraftTarget

        verdict = check(None, config, DraftTarget(config=target.config, path=target.path, num_layers=target.num_layers))
        if not verdict.ok:
            raise ValueError("the MTP drafter would not fit the target: " + "; ".join(verdict.reasons))
        self.config = config
        model = Assistant(AssistantArgs.from_dict(config)) if self.style == "assistant" else Head(HeadArgs.from_dict(config))
        if raw is not None:
            weights = model.sanitize(raw) if self.style == "assistant" else raw
            model.load_weights(list(weights.items()), strict=True)
        model.set_dtype(mx.float32)
        if self.style == "assistant":
            if config.get("use_ordered_embeddings") and raw is None:  # a new sparse head: clusters of consecutive ids
                model.masked_embedding.token_ordering = mx.arange(model.text.vocab_size, dtype=mx.int32)
            ta = gemma._target_args(target.config)
            from .assistant import target_kv_layers

            kv = target_kv_layers(ta.layer_types, ta.num_kv_shared_layers)
            self.kv = {kind: kv[kind] for kind in set(model.layer_types)}
            if min(self.kv.values()) == 0:
                raise ValueError("the target's K/V layer is its first layer: its input (the embedding) is not captured")
        self.embed = tg.embedding(target.model)
        self.head = tg.lm_head(target.model)
        self.norm = tg.final_norm(target.model)
        self.last = tg.last_layer(target.model)
        return model

    def _head_config(self, text: Dict[str, Any], trained_for: Optional[str] = None) -> Dict[str, Any]:
        text = dict(copy.deepcopy(text), mtp_num_hidden_layers=1)
        config = {"block_size": self.block_size, "model_type": "qwen3_5_mtp", "text_config": text,
                  "tie_word_embeddings": bool(text.get("tie_word_embeddings", False))}
        return {**config, qwen.TARGET_FIELD: trained_for} if trained_for else config

    def capture_layers(self) -> List[int]:
        if self.style == "assistant":
            return sorted({self.last, *(i - 1 for i in self.kv.values())})
        return [self.last]

    def features(self, target: TrainTarget, captures: Dict[int, mx.array]) -> Optional[mx.array]:
        hidden = self.norm(captures[self.last])  # [b, L, H]: the final hidden state, after the final norm
        if self.style == "head":
            return hidden.astype(mx.float32)
        self.kv_shape: Dict[str, Any] = {}
        parts = [hidden]
        for kind in sorted(self.kv):
            keys, values = objectives.layer_kv(target.model, self.kv[kind], captures[self.kv[kind] - 1])
            self.kv_shape[kind] = (keys.shape[1], keys.shape[-1])  # (n_kv, D)
            parts += [objectives.flat(keys), objectives.flat(values)]
        return mx.concatenate(parts, axis=-1).astype(mx.float32)  # [b, L, H + 2 * sum(n_kv * D)]

    def _steps(self, model: nn.Module, batch: Batch) -> List[mx.array]:
        if self.style == "head":
            return objectives.head_steps(model, self.embed, self.head, batch.tokens, batch.features, self.block_size - 1)
        return objectives.assistant_steps(model, self.embed, batch.tokens, batch.features, self.kv_shape,
                                          self.block_size - 1, model.args.text_config.get("sliding_window") or 0)

    def loss(self, model: nn.Module, batch: Batch) -> mx.array:
        if self.style == "head":
            return objectives.unrolled_loss(self._steps(model, batch), batch.tokens, batch.first)
        states = self._steps(model, batch)
        loss = objectives.unrolled_loss([model.dense_logits(s) for s in states], batch.tokens, batch.first)
        if model.args.use_ordered_embeddings:
            loss = loss + objectives.cluster_loss(model, states, batch.tokens, batch.first)
        return loss

    def draft(self, model: nn.Module, batch: Batch) -> mx.array:
        steps = self._steps(model, batch)
        if self.style == "assistant":
            steps = [model.logits(s) for s in steps]  # the sparse head, as decoding drafts
        drafts = mx.stack([mx.argmax(s, axis=-1) for s in steps], axis=-1)  # [b, L-1, B-1]: index p-1 drafts for p
        index = mx.array(batch.anchors, dtype=mx.int32) - 1  # [b, n]
        return mx.take_along_axis(drafts, index[..., None], axis=1)

    def anchors_per_forward(self, rows: int, vocab: int) -> int:
        return 1 << 30  # one unrolled forward serves every anchor

    def save(self, model: nn.Module, out_dir: Path, target: TrainTarget, dtype: mx.Dtype) -> List[str]:
        config = copy.deepcopy(self.config)
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tree_flatten(model.parameters())}
        name = str(dtype).split(".")[-1]
        config["block_size"] = self.block_size
        if self.style == "assistant":
            config["dtype"] = config["text_config"]["dtype"] = name
            if "masked_embedding.token_ordering" in weights:
                weights["masked_embedding.token_ordering"] = weights["masked_embedding.token_ordering"].astype(mx.int64)
            meta = "pt"
        else:
            config["text_config"]["dtype"] = name
            meta = "mlx"
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": meta})
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return ["config.json", "model.safetensors", *copy_tokenizer(target.path, out_dir)]

    def describe(self) -> str:
        if self.style == "assistant":
            t = self.config["text_config"]
            head = "sparse" if self.config.get("use_ordered_embeddings") else "dense"
            return (f"mtp gemma4_assistant, {t['num_hidden_layers']} layer(s) of width {t['hidden_size']}, {head} head, "
                    f"block size {self.block_size}")
        trained_for = self.config.get(qwen.TARGET_FIELD)
        return (f"mtp qwen3_5_mtp head (width {config_value(self.config, 'hidden_size')}"
                f"{f', for a {trained_for} target' if trained_for else ''}), block size {self.block_size}")
