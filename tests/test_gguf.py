"""GGUF checkpoints: tiny llama/qwen2/qwen3 files written with the gguf package's writer load with the same
logits as their weights in an mlx-lm folder; the tokenizer rebuilt from the metadata equals the original."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import greedy_reference, make_host, no_stop
from gguf_files import CODE, SPECIALS, USER_DEFINED, blocks, logits, permute, train_tokenizer, write_pair
from mlx_speculative.hooks import gguf as gg
from mlx_speculative.hooks import loading
from mlx_speculative.hooks.cli import main

pytestmark = pytest.mark.integration

IDS = [5, 17, 42, 99, 7, 3, 250, 64, 11]
KINDS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"]
TOKENIZER_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_tokenizers")
    out = {}
    for pre in ("qwen2", "llama-bpe", "smollm"):
        train_tokenizer(root / pre, pre)
        out[pre] = root / pre
    return out


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write(tmp_path: Path, tokenizers_dir: Dict[str, Path], arch: str, kind: str, **kw: Any):
    pre = TOKENIZER_PRE[arch]
    return write_pair(tmp_path / "files", arch, kind, tokenizers_dir[pre], pre, **kw)


def _load(path: Path):
    from mlx_lm import load

    return load(str(path))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_the_same_weights_from_safetensors(arch: str, kind: str, tmp_path: Path, cache: Path,
                                                        tokenizers_dir: Dict[str, Path],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path, ref_dir = _write(tmp_path, tokenizers_dir, arch, kind)
    ref = logits(_load(ref_dir)[0], IDS)
    # mlx-spec convert --dtype f32: every weight dense, exactly the dequantized blocks
    out = tmp_path / "f32"
    assert main(["convert", str(path), str(out), "--dtype", "f32"]) == 0
    np.testing.assert_allclose(logits(_load(out)[0], IDS), ref, rtol=1e-5, atol=1e-5)
    # --model x.gguf: converted once into the cache, each block type as MLX holds it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_speculative.gguf"):
        folder = loading.resolve_path(str(path))
    assert folder.parent == cache / "gguf"
    model = _load(folder)[0]
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) == (kind in gg.MLX_QUANTIZED)
    if kind in gg.MLX_QUANTIZED:
        assert (q_proj.group_size, q_proj.bits) == (32, gg.MLX_QUANTIZED[kind])
    dequantized = [r.getMessage() for r in caplog.records]
    if kind in gg.DEQUANTIZED:  # one line, naming the type and the dtype (float32: MLX runs on the CPU here)
        assert len(dequantized) == 1 and kind in dequantized[0] and "float32" in dequantized[0], dequantized
    else:
        assert dequantized == []
    np.testing.assert_allclose(logits(model, IDS), ref, rtol=1e-4, atol=1e-4)
    assert loading.resolve_path(str(path)) == folder  # the second load reads the cached folder


def test_llama_qk_permutation_is_undone(tmp_path: Path, cache: Path, tokenizers_dir: Dict[str, Path]) -> None:
    """llama.cpp stores llama's Q/K rows permuted for its RoPE; without un-permuting the logits differ."""
    path, ref_dir = _write(tmp_path, tokenizers_dir, "llama", "F32", permute_qk=False)
    ref = logits(_load(ref_dir)[0], IDS)
    assert np.abs(logits(_load(loading.resolve_path(str(path)))[0], IDS) - ref).max() > 0.1
    # permute then undo is the identity on any row-major array (quantized blocks included)
    rows = np.arange(256 * 3).reshape(256, 3)
    assert np.array_equal(np.array(gg._unpermute(mx.array(permute(rows, 4)), 4)), rows)


def test_rope_scaling_from_metadata(tmp_path: Path, cache: Path, tokenizers_dir: Dict[str, Path]) -> None:
    """Linear rope scaling (metadata) and Llama 3's (rope_freqs factors) give the reference's rope."""
    path, ref_dir = _write(tmp_path, tokenizers_dir, "llama", "Q8_0", rope_scaling={"type": "linear", "factor": 4.0})
    folder = loading.resolve_path(str(path))
    assert json.loads((folder / "config.json").read_text())["rope_scaling"]["factor"] == 4.0
    np.testing.assert_allclose(logits(_load(folder)[0], IDS), logits(_load(ref_dir)[0], IDS), atol=1e-4)

    # Llama 3.1's: llama.cpp keeps only the per-frequency factors (rope_freqs), made for an 8192 context
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    wavelen = 2 * np.pi * 10000.0 ** (np.arange(0, 64, 2) / 64)
    smooth = np.clip((8192 / wavelen - 1.0) / 3.0, 0, 1)
    factors = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)))
    assert ((factors > 1.0) & (factors < 8.0)).any()  # some frequencies lie between the two bounds
    for name, extra in (("l3", factors), ("other", factors * 1.5)):
        path, ref_dir = write_pair(tmp_path / name, "llama", "F32", tokenizers_dir["llama-bpe"], "llama-bpe",
                                   rope_scaling=scaling, extra={"rope_freqs.weight": extra.astype(np.float32)})
        if name == "other":
            with pytest.raises(gg.GGUFError, match="rope_freqs are not Llama 3's rope scaling"):
                loading.resolve_path(str(path))
            continue
        folder = loading.resolve_path(str(path))
        assert json.loads((folder / "config.json").read_text())["rope_scaling"] == scaling
        far = [(7 * i) % 400 for i in range(512)]  # positions far enough for the scaled frequencies to turn
        np.testing.assert_allclose(logits(_load(folder)[0], far), logits(_load(ref_dir)[0], far), atol=1e-4)


def test_tokenizer_round_trip(tmp_path: Path, cache: Path, tokenizers_dir: Dict[str, Path]) -> None:
    """Encode/decode and the chat template of the rebuilt tokenizer equal the original's, per pre-tokenizer."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer

    texts = CODE + ["the model token draft", "<|im_start|>user\nhi<|im_end|> <tool> x", "ünïcödé 東京 🙂 1234567"]
    messages = [{"role": "user", "content": "write add(a, b) 123"}]
    for pre, arch in (("qwen2", "qwen2"), ("llama-bpe", "llama"), ("smollm", "llama")):
        path, _ = write_pair(tmp_path / pre, arch, "Q8_0", tokenizers_dir[pre], pre)
        folder = loading.resolve_path(str(path))
        original = load_tokenizer(tokenizers_dir[pre])
        rebuilt = load_tokenizer(folder)
        # the file itself (transformers reads a qwen2 model's with its own Qwen2Tokenizer split)
        mine, theirs = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (folder, tokenizers_dir[pre]))
        for text in texts:
            assert mine.encode(text).ids == theirs.encode(text).ids, (pre, text)
            ids = original.encode(text, add_special_tokens=False)
            assert rebuilt.encode(text, add_special_tokens=False) == ids, (pre, text)
            assert rebuilt.encode(text) == original.encode(text)
            assert rebuilt.decode(ids) == original.decode(ids) == text
        assert (rebuilt.apply_chat_template(messages, add_generation_prompt=True)
                == original.apply_chat_template(messages, add_generation_prompt=True))
        assert rebuilt.eos_token_id == original.eos_token_id
        tokens = rebuilt._tokenizer.backend_tokenizer if hasattr(rebuilt._tokenizer, "backend_tokenizer") else None
        if tokens is not None:
            added = {t.content: t.special for t in tokens.get_added_tokens_decoder().values()}
            assert all(added[s] for s in SPECIALS) and not any(added[u] for u in USER_DEFINED)
    # tokenizer.ggml.add_bos_token: the BOS token starts every encoding that adds special tokens
    path, _ = write_pair(tmp_path / "bos", "llama", "Q8_0", tokenizers_dir["smollm"], "smollm", add_bos=True)
    rebuilt = load_tokenizer(loading.resolve_path(str(path)))
    bos = rebuilt.bos_token_id
    assert rebuilt.encode(texts[0]) == [bos] + rebuilt.encode(texts[0], add_special_tokens=False)


def test_split_shards_load_as_one_checkpoint(tmp_path: Path, cache: Path, tokenizers_dir: Dict[str, Path]) -> None:
    """llama.cpp's split shards (name-00001-of-0000N.gguf, the gguf writer's split) load from the first shard
    or their folder; a missing shard and a folder of several checkpoints are named."""
    path, ref_dir = _write(tmp_path, tokenizers_dir, "qwen2", "Q4_K", split=10)
    shards = sorted(path.parent.glob("*.gguf"))
    assert len(shards) > 2 and path.name.endswith("-00001-of-%05d.gguf" % len(shards))
    ref = logits(_load(ref_dir)[0], IDS)
    np.testing.assert_allclose(logits(_load(loading.resolve_path(str(path)))[0], IDS), ref, rtol=1e-4, atol=1e-4)
    assert loading.resolve_path(str(path.parent)) == loading.resolve_path(str(path))
    shards[-1].rename(tmp_path / "aside.gguf")
    with pytest.raises(gg.GGUFError, match=f"is shard 1 of {len(shards)}; missing: {shards[-1].name}"):
        gg.gguf_files(path)
    (tmp_path / "aside.gguf").rename(shards[-1])
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(gg.GGUFError, match="holds several GGUF checkpoints"):
        gg.gguf_files(path.parent)


def test_unsupported_types_and_architectures_are_named(tmp_path: Path, cache: Path,
                                                       tokenizers_dir: Dict[str, Path]) -> None:
    path, _ = _write(tmp_path, tokenizers_dir, "llama", "Q8_0", overrides={"blk.1.ffn_up.weight": "TQ2_0"})
    with pytest.raises(gg.GGUFError, match=r"TQ2_0 are not supported \(supported: F32, F16, BF16, Q4_0.*Q6_K\)"):
        loading.resolve_path(str(path))
    with pytest.raises(loading.CheckpointError, match="not a GGUF file"):
        loading.resolve_path(str(tmp_path / "files" / "llama-Q8_0-reference" / "config.json"))
    assert main(["convert", str(path), str(tmp_path / "out"), "--dtype", "f64"]) == 2
    from mlx_speculative.hooks.gguf_convert import build_config

    meta, tensors = gg.read_metadata([path])
    with pytest.raises(gg.GGUFError, match=r"architecture 'gemma' is not supported \(supported: llama, qwen2, qwen3\)"):
        build_config(dict(meta, **{"general.architecture": "gemma"}), tensors)
    with pytest.raises(gg.GGUFError, match="metadata lacks llama.feed_forward_length; expected every one of"):
        build_config({k: v for k, v in meta.items() if k != "llama.feed_forward_length"}, tensors)
    from mlx_speculative.hooks.gguf_tokenizer import build_tokenizer

    with pytest.raises(ValueError, match="GGUF tokenizer is 'llama'; only byte-level BPE"):
        build_tokenizer(dict(meta, **{"tokenizer.ggml.model": "llama"}))


def test_mlx_reader_and_gguf_blocks_agree(tmp_path: Path) -> None:
    """MLX's GGUF reader and this loader's own repacking give the same arrays for Q4_0, Q4_1 and Q8_0."""
    import gguf

    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (64, 96)).astype(np.float32)
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for kind in gg.MLX_QUANTIZED:
        data, qtype = blocks(w, kind, rng)
        writer.add_tensor(f"{kind}.weight", data, raw_dtype=qtype)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    native = mx.load(str(path))
    _, tensors = gg.read_metadata([path])
    for t in tensors:
        stem = t.name[: -len(".weight")]
        for mine, theirs in zip(gg._repack(t.data, stem), (native[t.name], native[stem + ".scales"], native[stem + ".biases"])):
            assert mine.dtype == theirs.dtype and np.array_equal(np.array(mine), np.array(theirs)), stem


def test_convert_writes_a_folder_mlx_lm_loads(tmp_path: Path, tokenizers_dir: Dict[str, Path],
                                             capsys: pytest.CaptureFixture) -> None:
    path, ref_dir = _write(tmp_path, tokenizers_dir, "qwen3", "Q4_0")
    out = tmp_path / "out"
    assert main(["convert", str(path.parent), str(out)]) == 0  # a folder holding one .gguf file
    assert "quantized layers at 4 bits" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    model = _load(out)[0]
    assert model.model.layers[0].mlp.up_proj.scales.dtype == mx.float16  # as the file stores them
    np.testing.assert_allclose(logits(model, IDS), logits(_load(ref_dir)[0], IDS), atol=0.05)  # float16 products
    assert main(["convert", str(path), str(out)]) == 2  # not over a folder that holds something
    assert "exists and is not empty" in capsys.readouterr().err


def test_speculative_greedy_with_gguf_target_equals_plain(tmp_path: Path, cache: Path,
                                                          tokenizers_dir: Dict[str, Path]) -> None:
    """A GGUF target and a GGUF draft model (its Q4_0 copy) through the host: greedy output is the target's."""
    target_path, _ = _write(tmp_path / "t", tokenizers_dir, "llama", "Q8_0", seed=4)
    draft_path, _ = _write(tmp_path / "d", tokenizers_dir, "llama", "Q4_0", seed=4)
    host = make_host({"draft_model": str(draft_path), "block_size": 4, "adaptive": False})
    target = host.load(str(target_path))
    accepted = 0
    for text in CODE[:3]:
        prompt = list(target.tokenizer.encode(text, add_special_tokens=False))
        result = host.generate(target, prompt, no_stop(24))
        assert result.tokens == greedy_reference(target.model, prompt, 24)
        accepted += result.report["speculative"].accepted_tokens
    assert accepted > 0


def test_yaml_and_cli_take_gguf_paths(tmp_path: Path, cache: Path, tokenizers_dir: Dict[str, Path],
                                      capsys: pytest.CaptureFixture) -> None:
    """A YAML's relative 'sub/x.gguf' is a file beside it (not a Hugging Face repo id); generate and check run on it."""
    from mlx_speculative.hooks.config import load_host_config

    target_path, _ = _write(tmp_path, tokenizers_dir, "qwen2", "Q8_0", seed=5)
    draft_path, _ = _write(tmp_path, tokenizers_dir, "qwen2", "Q4_0", seed=5)
    (tmp_path / "host.yaml").write_text(f"model: files/{target_path.name}\n"  # looks like 'org/name'
                                        f"speculative: {{draft_model: files/{draft_path.name}, block_size: 3}}\n")
    config = load_host_config(str(tmp_path / "host.yaml"))
    assert config.sections["model"] == str(target_path)
    assert config.sections["speculative"]["draft_model"] == str(draft_path)
    assert main(["generate", "--config", str(tmp_path / "host.yaml"), "--prompt", CODE[0], "--max-tokens", "12",
                 "--ignore-chat-template", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speculative"]["kind"] == "draft_model" and out["speculative"]["rounds"] > 0
    assert main(["check", "--model", str(target_path), "--draft-model", str(draft_path)]) == 0
    assert "verdict: compatible" in capsys.readouterr().out
