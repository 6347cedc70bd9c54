"""The pieces DFlash training relies on: the many-block forward is the decoding forward (one block
with its context in the cache), the features of a last-layer tap are the target's final normed
states (HF's hidden_states[N]), and config fields land where each layout keeps them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from mlx_speculative.drafters.dflash import features, tiny
from mlx_speculative.drafters.dflash.model import Model, ModelArgs
from mlx_speculative.hooks import taps
from mlx_speculative.testing import tiny_models as tm

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"


def _model(name: str, window: Any, tmp_path: Path) -> Model:
    real = json.loads((FIXTURES / f"{name}.config.json").read_text())
    config = tiny.shrink_config(real, target_layer_ids=[0, 1, 3], mask_token_id=383, num_target_layers=4,
                                sliding_window=window, block_size=6)
    model = Model(ModelArgs.from_dict(config))
    mx.random.seed(3)
    model.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.2, model.parameters()))
    return model


@pytest.mark.parametrize("name, window", [
    ("z-lab__Qwen3-8B-DFlash-b16", None),
    ("z-lab__Qwen3.5-4B-DFlash", 8),  # a sliding layer whose window is shorter than the context
    ("speculators-issue-613__dflash-qwen3.6-35b-a3b", None),  # partial rotary
])
def test_blocks_equal_the_decoding_forward(name: str, window: Any, tmp_path: Path) -> None:
    model = _model(name, window, tmp_path)
    H, T, S = model.args.hidden_size, 6, 24
    mx.random.seed(1)
    hidden = mx.random.normal((2, S, 3 * H))  # [b, S, taps*H]
    anchors = np.array([[3, 11, 17], [1, 9, 24]])  # [b, n]; 24: the whole context
    emb = mx.random.normal((2, 3, T, H))
    together = model.blocks(emb, hidden, mx.array(anchors))  # [b, n, T, H]
    for r in range(2):
        for j, p in enumerate(anchors[r]):
            # Decoding: the context positions < p fed into the cache, then the block at positions p..
            cache = model.make_cache()
            if p:
                model.append_context(hidden[r:r + 1, :p], cache)
            alone = model(emb[r:r + 1, j], cache)  # [1, T, H]
            assert mx.allclose(together[r, j], alone[0], atol=1e-4).item(), (r, int(p))
    # The block, not only the context, is seen: another mask token changes every position's output.
    moved = model.blocks(emb.at[0, 0, 3].add(1.0), hidden, mx.array(anchors))
    assert not mx.allclose(moved[0, 0, 0], together[0, 0, 0], atol=1e-4).item()
    assert mx.allclose(moved[0, 1], together[0, 1], atol=1e-6).item()  # blocks do not see each other


def test_last_layer_features_are_the_final_normed_states(tmp_path: Path) -> None:
    from mlx_lm import load

    target_dir = tm.make_checkpoint(tmp_path / "t", tm.llama_config(num_hidden_layers=3), seed=4)
    model, _ = load(str(target_dir))
    layers = [0, 2]
    taps.install_taps(model, layers)
    tokens = mx.array([[5, 9, 40, 7, 100, 3]], dtype=mx.uint32)
    with taps.record(layers) as rec:
        logits = model(tokens)  # [1, 6, V]
    final = features.final_norm_tap(model, layers)
    assert final is not None and final[0] == 2
    feats = features.target_features({i: rec[i][0] for i in layers}, layers, final)  # [1, 6, 2*H]
    H = model.args.hidden_size
    assert feats.shape == (1, 6, 2 * H)
    assert mx.allclose(feats[..., :H], rec[0][0]).item()  # a middle layer: its raw output
    assert mx.allclose(model.lm_head(feats[..., H:]), logits, atol=1e-4).item()  # the last: what the head reads
    assert features.final_norm_tap(model, [0, 1]) is None
    with pytest.raises(RuntimeError, match=r"did not capture layers \[1\]"):
        features.target_features({0: rec[0][0]}, [0, 1])


def test_shrink_config_puts_block_size_where_the_layout_keeps_it() -> None:
    nested = json.loads((FIXTURES / "z-lab__Qwen3.5-4B-DFlash.config.json").read_text())
    shrunk = tiny.shrink_config(nested, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4, block_size=8)
    assert shrunk["dflash_config"]["block_size"] == 8 and "block_size" not in shrunk
    assert ModelArgs.from_dict(shrunk).block_size == 8
    flat = json.loads((FIXTURES / "z-lab__Qwen3-8B-DFlash-b16.config.json").read_text())
    shrunk = tiny.shrink_config(flat, target_layer_ids=[0, 2], mask_token_id=383, num_target_layers=4, block_size=8)
    assert shrunk["block_size"] == 8 and "block_size" not in shrunk["dflash_config"]
    assert ModelArgs.from_dict(shrunk).block_size == 8
