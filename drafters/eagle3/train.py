"""Training EAGLE-3 drafters (``mlx-spec train-drafter --kind eagle3``): the training-time test.

The chain is unrolled over every position at once (``Model.unrolled``): step 0 reads the target's
features of position t with the token at t + 1, step s reads step s-1's own output state with the
token at t + 1 + s, and predicts the target's token at t + 2 + s, seeing what decoding's draft
step s + 1 sees (the features up to t, its own earlier chain positions). Tokens are the target's
(teacher forcing): within an accepted prefix they are what the drafter drafted. Cross-entropy over
the draft vocabulary; labels outside it are left out. A new drafter's draft vocabulary is the
``--draft-vocab-size`` most frequent tokens of the target's continuations (EAGLE's choice).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..base import DraftTarget
from ..compat import config_value
from ..training.spec import Batch, FamilyTrainer, TrainOptions, TrainTarget
from .check import check
from .model import DEFAULT_BLOCK_SIZE, OUTPUT, Model, ModelArgs, canonical_name, checkpoint_name
from .tiny import vocab_maps

DEFAULT_DRAFT_VOCAB = 32000  # EAGLE-3's and SpecForge's


def default_layer_ids(num_target_layers: int) -> List[int]:
    """Outputs of layers [1, N//2 - 1, N - 4] (the published hidden_states[2, N//2, N-3]); evenly
    spread where that repeats a layer or leaves the target (small targets)."""
    n = num_target_layers
    ids = [1, n // 2 - 1, n - 4]
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    return [int(round(x)) for x in np.linspace(0, n - 1, 3)]


def new_config(target: TrainTarget, layer_ids: List[int], draft_vocab: int) -> Dict[str, Any]:
    """A config.json in SpecForge's layout (``LlamaForCausalLMEagle3`` + ``eagle_config``: the
    layer ids are stored, as the output of layer i) sized from the target's config."""
    c = target.config
    value = lambda key, default=None: default if config_value(c, key) is None else config_value(c, key)  # noqa: E731
    hidden, heads = int(value("hidden_size")), int(value("num_attention_heads"))
    rope = value("rope_parameters", {}) or {}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sorted(layer_ids), "use_aux_hidden_state": True},
        "attention_bias": False,
        "bos_token_id": value("bos_token_id"),
        "draft_vocab_size": int(draft_vocab),
        "eos_token_id": value("eos_token_id"),
        "head_dim": int(value("head_dim", hidden // heads)),
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(value("intermediate_size", 3 * hidden)),
        "max_position_embeddings": int(value("max_position_embeddings", 32768)),
        "model_type": "llama",
        "num_attention_heads": heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": int(value("num_key_value_heads", heads)),
        "rms_norm_eps": float(value("rms_norm_eps", 1e-6)),
        "rope_scaling": value("rope_scaling"),
        "rope_theta": float(value("rope_theta", rope.get("rope_theta", 10000.0))),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": int(value("vocab_size")),
    }


def _weight(module: nn.Module) -> mx.array:
    """A linear or embedding module's [out, in] weight, dequantized when quantized."""
    if "scales" in module:
        return mx.dequantize(module.weight, module.scales, module.get("biases"), module.group_size, module.bits)
    return module.weight


def target_head_and_norm(model: nn.Module) -> tuple:
    """The target's output head weight [V, H] (tied: the embedding) and final norm weight [H]."""
    from ..target_parts import target_embedding_and_head, target_final_norm

    embed, head = target_embedding_and_head(model)
    owner = getattr(head, "__self__", None)  # tied: embed.as_linear
    weight = _weight(owner if owner is not None else head)
    return weight, target_final_norm(model).weight


class Eagle3Trainer(FamilyTrainer):
    kind = "eagle3"
    default_block_size = DEFAULT_BLOCK_SIZE
    family_options = ("target_layers", "draft_vocab_size")

    def __init__(self, options: TrainOptions):
        super().__init__(options)
        self.config: Dict[str, Any] = {}
        self.args: Optional[ModelArgs] = None
        self.extras: Dict[str, mx.array] = {}  # tensors of --init carried over untrained
        self.draft_ids: List[int] = []
        self.choose_vocab = False
        self.head: Optional[tuple] = None  # (new model, (target head [V, H], final norm [H])) until data_ready

    @classmethod
    def check_options(cls, o: TrainOptions) -> None:
        super().check_options(o)
        if o.num_layers not in (None, 1):
            raise ValueError(f"--num-layers: got {o.num_layers}; eagle3 drafters written here have one decoder layer")
        if o.draft_vocab_size is not None and o.draft_vocab_size < 1:
            raise ValueError(f"--draft-vocab-size: got {o.draft_vocab_size}; allowed: 1 or more (at most the target's vocab_size)")
        if o.target_layers is not None and (not o.target_layers or min(o.target_layers) < 0):
            raise ValueError(f"--target-layers: got {o.target_layers}; allowed: decoder layer ids (0 or more)")
        if o.init is not None and (o.target_layers is not None or o.draft_vocab_size is not None):
            raise ValueError("--init: the layers and the draft vocabulary come from its checkpoint; leave out "
                             "--target-layers and --draft-vocab-size")

    def build(self, target: TrainTarget) -> nn.Module:
        from . import build as build_model
        from . import detect

        o = self.options
        vocab = int(config_value(target.config, "vocab_size"))
        if o.init is not None:
            path, config = self.init_checkpoint(detect, "is not an EAGLE-3 drafter (none of the EAGLE, SpecForge, "
                                                        "speculators layouts)")
            model, raw = build_model(path, config)
            args = model.args
            d2t = raw.get("d2t")
            base = np.arange(args.draft_vocab_size)
            self.draft_ids = (base if d2t is None else base + np.array(d2t)).tolist()
            names = {k for k, _ in tree_flatten(model.parameters())}
            self.extras = {k: v for k, v in raw.items() if canonical_name(k) not in names and k not in ("d2t", "t2d")}
        else:
            if o.draft_vocab_size is not None and o.draft_vocab_size > vocab:
                raise ValueError(f"--draft-vocab-size: got {o.draft_vocab_size}; allowed: 1 to the target's vocab_size {vocab}")
            draft_vocab = min(o.draft_vocab_size or DEFAULT_DRAFT_VOCAB, vocab)
            config = new_config(target, o.target_layers or default_layer_ids(target.num_layers), draft_vocab)
            args = ModelArgs.from_dict(config)
            model = Model(args)
            self.draft_ids = list(range(draft_vocab))
            self.choose_vocab = draft_vocab < vocab
            self.head = (model, target_head_and_norm(target.model))
        verdict = check(None, config, DraftTarget(config=target.config, path=target.path, num_layers=target.num_layers))
        if not verdict.ok:
            raise ValueError("the EAGLE-3 drafter would not fit the target: " + "; ".join(verdict.reasons))
        self.config, self.args = config, args
        model.set_dtype(mx.float32)
        if "embed_tokens" in model:
            model.embed_tokens.freeze()  # the target's embedding, copied (EAGLE keeps it frozen)
            self.embed = model.embed_tokens
        else:
            from ..target_parts import target_embedding_and_head

            self.embed = target_embedding_and_head(target.model)[0]
        self.capture = args.capture_layers(target.num_layers)
        self._set_vocab(vocab)
        return model

    def _set_vocab(self, vocab: int) -> None:
        self.targets = mx.array(self.draft_ids, dtype=mx.uint32)  # [draft_vocab] target ids
        index = np.full(vocab, -1, dtype=np.int32)
        index[np.array(self.draft_ids)] = np.arange(len(self.draft_ids))
        self.to_draft = mx.array(index)  # [vocab] draft id, -1 outside the draft vocabulary

    def data_ready(self, sequences: np.ndarray, first: int) -> None:
        if self.head is None:
            return
        vocab = int(self.args.vocab_size)
        if self.choose_vocab:
            counts = np.bincount(sequences[:, first + 1:].reshape(-1), minlength=vocab)
            order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, then the lower id
            self.draft_ids = sorted(order[: len(self.draft_ids)].tolist())
            self._set_vocab(vocab)
        # A new drafter's head starts as the target's rows of its draft vocabulary, its norm as the
        # target's final norm (as speculators initialise theirs): it then learns to predict the
        # target's last state at the next position. A resumed run loads its own weights after this.
        model, (head, norm) = self.head
        model.lm_head.weight = head[self.targets].astype(mx.float32)
        model.norm.weight = norm.astype(mx.float32)
        self.head = None

    def capture_layers(self) -> List[int]:
        return list(self.capture)

    def features(self, target: TrainTarget, captures: Dict[int, mx.array]) -> Optional[mx.array]:
        return mx.concatenate([captures[i] for i in self.capture], axis=-1).astype(mx.float32)

    def _logits(self, model: Model, batch: Batch) -> List[mx.array]:
        """Per chain step s: [b, T, draft_vocab] logits at index t = 0..L-2 (see the module doc)."""
        tokens = batch.tokens  # [b, L]
        b, L = tokens.shape
        hidden = model.project(batch.features[:, : L - 1])  # [b, T, H]
        embs = []
        for s in range(self.block_size - 1):
            ids = tokens[:, 1 + s:]  # the token at t + 1 + s
            ids = mx.concatenate([ids, mx.zeros((b, s), ids.dtype)], axis=1) if s else ids
            embs.append(self.embed(ids).astype(mx.float32))
        return [model.logits(h) for h in model.unrolled(embs, hidden)]

    def loss(self, model: nn.Module, batch: Batch) -> mx.array:
        tokens = batch.tokens
        b, L = tokens.shape
        total, count = mx.array(0.0), mx.array(0.0)
        for s, logits in enumerate(self._logits(model, batch)):
            at = mx.arange(L - 1) + 2 + s  # the label's position for index t
            labels = mx.concatenate([tokens[:, 2 + s:], mx.zeros((b, s + 1), tokens.dtype)], axis=1)  # [b, T]
            draft = self.to_draft[labels]  # [b, T]
            valid = (draft >= 0) & (at[None] < L) & (at[None] > batch.first)
            ce = nn.losses.cross_entropy(logits, mx.maximum(draft, 0))  # [b, T]
            total = total + (ce * valid).sum()
            count = count + valid.sum()
        return total / mx.maximum(count, 1)

    def draft(self, model: nn.Module, batch: Batch) -> mx.array:
        ids = mx.stack([mx.argmax(l, axis=-1) for l in self._logits(model, batch)], axis=-1)  # [b, T, B-1]
        at = mx.array(np.asarray(batch.anchors) - 1, dtype=mx.int32)[..., None]  # [b, n, 1]: index t = p - 1
        return self.targets[mx.take_along_axis(ids, at, axis=1)]  # [b, n, B-1]

    def anchors_per_forward(self, rows: int, vocab: int) -> int:
        return 1 << 30  # one unrolled forward drafts at every anchor

    def save(self, model: nn.Module, out_dir: Path, target: TrainTarget, dtype: mx.Dtype) -> List[str]:
        config = copy.deepcopy(self.config)
        key = "dtype" if "dtype" in config and "torch_dtype" not in config else "torch_dtype"
        config[key] = str(dtype).split(".")[-1]
        layout = self.args.layout
        weights = dict(self.extras)
        for name, w in tree_flatten(model.parameters()):
            weights[checkpoint_name(name, layout)] = w.astype(dtype)
        weights.update(vocab_maps(self.draft_ids, int(self.args.vocab_size)))
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return ["config.json", "model.safetensors"]

    def describe(self) -> str:
        a = self.args
        where = "output of layer i" if a.layer_convention == OUTPUT else "hidden_states[i]"
        return (f"eagle3 drafter ({a.layout} layout), {a.num_hidden_layers} layer(s), chain depth {self.block_size - 1}, "
                f"layer ids {a.layer_ids(0) if a.aux_layer_ids else 'default'} ({where}) -> target layer outputs "
                f"{self.capture}, draft vocabulary {a.draft_vocab_size} of {a.vocab_size}")
