"""MTP drafters on synthetic targets: mlx-lm's ``generate_step`` against the plugin's MTP rounds.

Not a test. A Qwen3.5-shape target with a random ``mtp.*`` head (family qwen3_5_mtp: its own KV
cache, applied recursively past its depth of 1) or a Gemma-4-shape target with a random assistant of
google/gemma-4-E2B-it-assistant's shape (family gemma4_assistant: the target's K/V, the sparse head),
random weights built in memory. Proposals come from the oracle of ``mlx-spec bench`` (the drafter
still runs; its tokens are replaced by the target's continuation, right with the probability that
gives the mean acceptance length ``--oracle-tau``), so the speed-up measures the machinery at a
chosen acceptance. Greedy; every run's tokens are compared with plain decoding's.

    python bench/mtp_synthetic.py --shape qwen3_5-27b --oracle-tau 3.5 --block-sizes 4 --json bench/results/h200-mtp-qwen3_5.json
    python bench/mtp_synthetic.py --shape gemma4-e2b --oracle-tau 3.5 --block-sizes 4 --json bench/results/h200-mtp-gemma4.json
    python bench/mtp_synthetic.py --shape tiny-gemma4 --cpu --prompt-lengths 64 --max-tokens 32   # CPU smoke run

Shapes: ``qwen3_5-27b``: attention, MLP and head sizes from Qwen3.6-27B's published ``mtp.*`` tensors
(hidden 5120, 24 heads of 256 with output gates, 4 KV heads, MLP 17408), GatedDeltaNet sizes and the
layer count assumed (64 layers, every 4th full attention; 48 value / 16 key heads of 128), vocab
248320. ``gemma4-e2b``: mlx-lm's gemma4_text defaults (gemma-4-E2B: hidden 1536, 35 layers of which
20 share K/V, per-layer inputs, sliding window 512, vocab 262144) and the E2B assistant's config.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_speculative.drafters.mtp import assistant as asst
from mlx_speculative.drafters.mtp import gemma4_assistant, qwen3_5_mtp, tiny
from mlx_speculative.drafters.mtp import target as tg
from mlx_speculative.drafters.mtp.batch import HeadDrafter
from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.state import LoadedTarget
from mlx_speculative.benchmarks.methods import HostMethod, MlxLmPlain, divergence, reference

ROOT = Path(__file__).resolve().parents[1]
ASSISTANT = json.loads((ROOT / "tests" / "fixtures" / "mtp" / "google__gemma-4-E2B-it-assistant.config.json").read_text())
QUIET = 0.1  # scale of each block's contribution: the residual stream stays near the token (large logit margins)

QWEN3_5_27B = dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                   num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320, rms_norm_eps=1e-6,
                   linear_num_value_heads=48, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                   linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=False, mtp_num_hidden_layers=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [11, 11, 10]})
SHAPES = {
    "qwen3_5-27b": ("qwen", {"model_type": "qwen3_5", "text_config": QWEN3_5_27B, "tie_word_embeddings": False}, "bfloat16"),
    "gemma4-e2b": ("gemma", {"model_type": "gemma4_text", "vocab_size": 262144}, "bfloat16"),
    "tiny-qwen3_5": ("qwen", tiny.qwen3_5_config(), "float32"),
    "tiny-gemma4": ("gemma", tiny.gemma4_text_config(), "float32"),
}


def build_target(family: str, config: Dict[str, Any], dtype: str, seed: int) -> Any:
    """Random weights with large logit margins: each block's output scaled by QUIET (Gemma: its
    post-norms, which would undo a scaled projection), an untied head pointing at a permutation."""
    mx.random.seed(seed)
    model = tm.build_model(config)
    quiet = ("o_proj.weight", "out_proj.weight", "down_proj.weight") if family == "qwen" else (
        "post_attention_layernorm.weight", "post_feedforward_layernorm.weight", "post_per_layer_input_norm.weight")
    updates = [(k, v * QUIET) for k, v in tree_flatten(model.parameters()) if k.endswith(quiet) and ".layers." in k]
    if family == "qwen":
        embed = model.language_model.model.embed_tokens.weight
        unit = embed / mx.sqrt((embed * embed).sum(-1, keepdims=True))
        perm = mx.random.permutation(embed.shape[0])
        updates += [("language_model.lm_head.weight", unit[mx.argsort(perm)]),
                    ("language_model.model.embed_tokens.weight", unit * 10.0)]
    model.load_weights(updates, strict=False)
    model.set_dtype(getattr(mx, dtype))
    for _, p in tree_flatten(model.parameters()):
        mx.eval(p)
    model.eval()
    return model


def build_drafter(family: str, model: Any, config: Dict[str, Any], dtype: str, seed: int) -> Tuple[Any, str]:
    mx.random.seed(seed)
    if family == "qwen":
        head = qwen3_5_mtp.Model(qwen3_5_mtp.ModelArgs.from_dict(config))
        head.set_dtype(getattr(mx, dtype))
        drafter = HeadDrafter("qwen3_5_mtp", head, tg.embedding(model), tg.lm_head(model), tg.final_norm(model),
                              tg.last_layer(model), 2)
        return drafter, "qwen3_5_mtp head (random; one full-attention layer, its own KV cache)"
    text = model.args
    acfg = copy.deepcopy(ASSISTANT)
    if text.hidden_size < 1536:  # the tiny shape
        acfg = tiny.assistant_config(ASSISTANT, tiny.gemma4_text_config())
    acfg["backbone_hidden_size"] = text.hidden_size
    net = gemma4_assistant.Model(gemma4_assistant.ModelArgs.from_dict(acfg))
    net.update({"masked_embedding": {"token_ordering": mx.random.permutation(text.vocab_size).astype(mx.int32)}})
    net.set_dtype(getattr(mx, dtype))
    kv = asst.target_kv_layers(text.layer_types, text.num_kv_shared_layers)
    drafter = asst.AssistantDrafter(net, tg.embedding(model), tg.final_norm(model), tg.last_layer(model),
                                    {k: kv[k] for k in set(net.layer_types)}, text.sliding_window, 4)
    t = acfg["text_config"]
    return drafter, (f"gemma4_assistant (random; {t['num_hidden_layers']} layers of width {t['hidden_size']}, sparse head "
                     f"{acfg['centroid_intermediate_top_k']} of {acfg['num_centroids']} clusters)")


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--oracle-tau", type=float, default=3.5)
    p.add_argument("--block-sizes", default="4", help="block sizes (comma-separated; tau must fit each)")
    p.add_argument("--prompt-lengths", default="128,512,1024")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.cpu:
        mx.set_default_device(mx.cpu)
    family, config, dtype = SHAPES[a.shape]
    model = build_target(family, config, dtype, a.seed)
    vocab = int(tg._inner(model)[1].embed_tokens.weight.shape[0])
    target = LoadedTarget(model=model, tokenizer=None, path=Path("synthetic"), model_config=config, name=a.shape)
    drafter, desc = build_drafter(family, model, config, dtype, a.seed + 1)
    blocks = [int(b) for b in a.block_sizes.split(",")]
    methods = [MlxLmPlain(model), HostMethod(target, "host plain", None)]
    methods += [HostMethod(target, f"plugin mtp b{b} tau{a.oracle_tau:g}", None, drafter, b, a.oracle_tau, False, vocab)
                for b in blocks]
    stream = [random.Random(a.seed).randrange(2, vocab - 1) for _ in range(max(map(int, a.prompt_lengths.split(","))))]
    for m in methods:  # warm-up
        m.run(stream[:16], 8, reference(target, stream[:16], 8, None), a.seed)
    runs = []
    for L in (int(x) for x in a.prompt_lengths.split(",")):
        ref = reference(target, stream[:L], a.max_tokens, None)
        base = None
        for m in methods:
            r = m.run(stream[:L], a.max_tokens, ref, a.seed + L)
            base = r.tok_s if base is None else base
            spec = r.spec or {}
            row = {"method": m.name, "prompt_len": L, "tok_s": round(r.tok_s, 2), "speedup": round(r.tok_s / base, 3),
                   "tau": round(spec.get("mean_acceptance_length", 0.0), 3) if spec else None,
                   "identical": divergence(r.tokens, ref)["identical"]}
            runs.append(row)
            print(json.dumps(row), flush=True)
    report = {"shape": a.shape, "drafter": desc, "oracle_tau": a.oracle_tau, "max_tokens": a.max_tokens,
              "device": str(mx.default_device()), "platform": platform.platform(), "runs": runs}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"[bench] wrote {a.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
