"""DFlash drafters' config.json layouts: z-lab (flat and ``dflash_config``), speculators and the flat Muse-Glimmer
assistant, read into one flat dict (``normalize_config``, what ``model.ModelArgs`` takes) and written back in
place (``set_dflash_fields``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

# Architectures of the DFlash2 line: extra convolutions and a candidate selector this model lacks.
UNSUPPORTED_ARCHITECTURES = ("DFlash2DraftModel",)
MUSE_ASSISTANT = ("MuseGlimmerAssistantModel",)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """z-lab's default taps when a config names none: spread over layers 1 .. N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def config_layout(config: Dict[str, Any]) -> str:
    """Which DFlash config convention a config.json follows (see tests/fixtures/dflash).

    - ``dflash_config``: z-lab. Qwen3 b16 drafters keep ``block_size`` at the top level,
      Qwen3.5-4B-DFlash and later only inside ``dflash_config``.
    - ``speculators``: vllm-project/speculators; geometry under ``transformer_layer_config``, taps
      in ``aux_hidden_state_layer_ids``, ``mask_token_id``/``block_size`` at the top level.
    - ``flat``: the Muse-Glimmer assistant; ``block_size``, ``mask_token_id``, ``target_layer_ids``
      at the top level.
    """
    if config.get("speculators_model_type") == "dflash" or (
        (config.get("speculators_config") or {}).get("algorithm") == "dflash"
    ):
        return "speculators"
    if isinstance(config.get("dflash_config"), dict):
        return "dflash_config"
    return "flat"


def normalize_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """One flat dict with HF field names out of any of the three layouts."""
    layout = config_layout(config)
    flat = dict(config)
    if layout == "speculators":
        layer = dict(config.get("transformer_layer_config") or {})
        flat = {**layer, **{k: v for k, v in config.items() if k != "transformer_layer_config"}}
        flat["model_type"] = layer.get("model_type", "llama")
        if "aux_hidden_state_layer_ids" in config:
            flat["target_layer_ids"] = config["aux_hidden_state_layer_ids"]
        # speculators keep the vocabulary in the layer config; draft_vocab_size is the head's.
        flat.setdefault("vocab_size", layer.get("vocab_size"))
    elif layout == "dflash_config":
        # A value at both levels (block_size in some exports): dflash_config wins, it is what
        # z-lab's own loader reads for everything DFlash-specific.
        flat.update({k: v for k, v in config["dflash_config"].items()
                     if k in ("block_size", "mask_token_id", "target_layer_ids")})
    if set(config.get("architectures") or []) & set(MUSE_ASSISTANT) or config.get("model_type") == "muse_glimmer_assistant":
        # exllamav3's adapter reads these ids as raw HF hidden_states indices (tap_shift 0), not
        # DFlash's "output of layer id" (hidden_states[id + 1]).
        flat["layer_id_offset"] = 0
    rope = config.get("rope_parameters") or flat.get("rope_parameters")
    if isinstance(rope, dict):
        flat.setdefault("rope_theta", rope.get("rope_theta"))
        if "partial_rotary_factor" in rope:
            flat.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
        if rope.get("rope_type", rope.get("type", "default")) != "default" and not flat.get("rope_scaling"):
            flat["rope_scaling"] = rope
    if flat.get("use_sliding_window") is False:
        flat["sliding_window"] = None  # Qwen3Config ignores the window unless use_sliding_window
    flat["layout"] = layout
    return {k: v for k, v in flat.items() if v is not None or k == "sliding_window"}


def set_dflash_fields(
    config: Dict[str, Any], *, block_size: Optional[int] = None, mask_token_id: Optional[int] = None,
    target_layer_ids: Optional[List[int]] = None, num_target_layers: Optional[int] = None,
) -> Dict[str, Any]:
    """Write DFlash fields where ``config``'s layout keeps them (the inverse of ``normalize_config``), in place.

    z-lab: ids and mask token in ``dflash_config``; ``block_size`` where the config already has it
    (top level for the Qwen3 b16 drafters, ``dflash_config`` for Qwen3.5-4B; both when both).
    speculators: ``aux_hidden_state_layer_ids`` and the rest at the top level. flat: the top level.
    """
    layout = config_layout(config)
    if layout == "dflash_config":
        nested = config["dflash_config"]
        if target_layer_ids is not None:
            nested["target_layer_ids"] = list(target_layer_ids)
        if mask_token_id is not None:
            nested["mask_token_id"] = int(mask_token_id)
        if block_size is not None:
            if "block_size" in nested:
                nested["block_size"] = int(block_size)
            if "block_size" in config or "block_size" not in nested:
                config["block_size"] = int(block_size)
        if num_target_layers is not None:
            config["num_target_layers"] = int(num_target_layers)
        return config
    ids_field = "aux_hidden_state_layer_ids" if layout == "speculators" else "target_layer_ids"
    if target_layer_ids is not None:
        config[ids_field] = list(target_layer_ids)
    if mask_token_id is not None:
        config["mask_token_id"] = int(mask_token_id)
    if block_size is not None:
        config["block_size"] = int(block_size)
    if num_target_layers is not None and "num_target_layers" in config:
        config["num_target_layers"] = int(num_target_layers)
    return config
