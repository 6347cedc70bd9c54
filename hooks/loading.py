"""Finding and checking checkpoints: local paths or Hugging Face repo ids, offline-capable."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Tuple

from . import knobs

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]

# Symbolic names of the embedded demo (mlx_speculative/demo/: a small llama trained on the Python
# standard library and its drafters, shipped with the package), accepted wherever a model is named
# (flags, YAML, requests). They always mean the demo (a folder called "demo" is ./demo).
DEMO_TARGET = "demo"
DEMO_DRAFTER = "demo-drafter"  # the demo's DFlash drafter
DEMO_DRAFTERS = {DEMO_DRAFTER: "dflash", "demo-dflash": "dflash", "demo-eagle3": "eagle3", "demo-mtp": "mtp",
                 "demo-draft-model": "draft_model"}
SYMBOLIC = (DEMO_TARGET, *DEMO_DRAFTERS)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what was expected and found."""


def demo_path(name: str) -> Path:
    """The folder of a demo name (``demo``, ``demo-drafter``, ``demo-<kind>``)."""
    from ..demo import drafter_dir, target_dir

    path = target_dir() if name == DEMO_TARGET else drafter_dir(DEMO_DRAFTERS[name])
    if not (path / "model.safetensors").is_file():
        raise CheckpointError(f"{name!r}: the embedded demo's checkpoint {path} is missing; this installation lacks "
                              f"the demo's weights (reinstall the package, or make them with python -m "
                              f"mlx_speculative.demo.build)")
    return path


def demo_pair() -> Tuple[Path, Path]:
    """(target, DFlash drafter) folders of the embedded demo."""
    return demo_path(DEMO_TARGET), demo_path(DEMO_DRAFTER)


def resolve_relative(spec: str, base: Path) -> str:
    """A model value from a YAML file in folder ``base``: relative paths are read from ``base``.

    Symbolic names, absolute and ~ paths stay as they are; so does a value that looks like a
    Hugging Face repo id ('org/name') unless ``base/value`` exists (a folder or a .gguf file).
    """
    if spec in SYMBOLIC or spec.startswith(("/", "~")) or Path(spec).is_absolute():
        return spec
    candidate = base / spec
    if candidate.exists() or spec.startswith(".") or not _REPO_ID.match(spec):
        return str(candidate)
    return spec


def resolve_path(spec: str, what: str = "model") -> Path:
    """A local directory for ``spec``: a symbolic name (``demo``, ``demo-drafter``, ``demo-<kind>``),
    an existing path, or a repo id from the HF cache/hub. A GGUF checkpoint (a .gguf file, its first
    shard, or a folder holding one) gives the mlx-lm folder it is converted into once (hooks/gguf.py).

    With ``HF_HUB_OFFLINE=1`` only the local cache is used.
    """
    if spec in SYMBOLIC:
        return demo_path(spec)
    path = Path(spec).expanduser()
    if path.exists():
        from . import gguf

        if gguf.is_gguf(path):
            from .gguf_convert import cached_folder

            return cached_folder(path, what)
        if not path.is_dir():
            raise CheckpointError(f"{what} path {spec!r} is a file but not a GGUF file; expected a checkpoint "
                                  "directory or a .gguf file")
        return path
    if not _REPO_ID.match(spec) or spec.startswith((".", "/", "~")):
        raise CheckpointError(
            f"{what} {spec!r} not found: expected an existing directory or .gguf file, a Hugging Face repo id "
            f"like 'org/name', or {DEMO_TARGET!r} / {DEMO_DRAFTER!r} (the embedded demo; also "
            f"{', '.join(repr(n) for n in DEMO_DRAFTERS if n != DEMO_DRAFTER)})"
        )
    try:
        from huggingface_hub import snapshot_download

        offline = knobs.value("offline")  # runtime.offline / $HF_HUB_OFFLINE
        return Path(snapshot_download(spec, allow_patterns=_PATTERNS, local_files_only=offline))
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many types
        raise CheckpointError(
            f"{what} {spec!r} is neither a local directory nor available as a Hugging Face repo "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def read_config(path: Path, what: str = "model") -> Dict[str, Any]:
    """config.json of a checkpoint, checked for a ``model_type``."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{what} {str(path)!r} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} config {str(config_file)!r} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{what} config {str(config_file)!r} must be a JSON object, got {type(config).__name__}")
    # speculators-format drafters keep model_type inside transformer_layer_config.
    if "model_type" not in config and "text_config" not in config and "speculators_model_type" not in config:
        raise CheckpointError(
            f"{what} config {str(config_file)!r} has no 'model_type'; expected e.g. "
            "\"model_type\": \"llama\""
        )
    return config


# Bytes per element of the safetensors dtypes.
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
               "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorHeader:
    """What a safetensors header says of one tensor (its data is not read)."""

    dtype: str
    shape: Tuple[int, ...]
    file: Path


def _read_header(f: Path) -> Dict[str, TensorHeader]:
    size = f.stat().st_size
    with f.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"the file has {size} bytes, less than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n <= 0 or 8 + n > size:
            raise ValueError(f"header length {n} does not fit in a {size}-byte file")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    out: Dict[str, TensorHeader] = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = v["dtype"], tuple(int(d) for d in v["shape"]), v["data_offsets"]
        if 8 + n + end > size:
            raise ValueError(f"tensor {name!r} ends at byte {8 + n + end} but the file has {size}")
        count = 1
        for d in shape:
            count *= d
        if dtype in DTYPE_BYTES and end - start != count * DTYPE_BYTES[dtype]:
            raise ValueError(f"tensor {name!r}: {dtype} {list(shape)} needs {count * DTYPE_BYTES[dtype]} bytes, "
                             f"its data_offsets give {end - start}")
        out[name] = TensorHeader(dtype, shape, f)
    return out


def safetensors_headers(path: Path, what: str = "model", required: bool = True) -> Dict[str, TensorHeader]:
    """Name -> dtype and shape of every tensor in a checkpoint's *.safetensors files, from the
    headers alone (no tensor data is read; each file's size is checked against its header).

    ``required=False``: a folder without weight files (config-only, e.g. checking a published
    config.json) gives {} instead of an error."""
    files = sorted(path.glob("*.safetensors"))
    if not files and not required:
        return {}
    if not files:
        raise CheckpointError(f"{what} {str(path)!r} has no *.safetensors weights (only safetensors are loaded)")
    out: Dict[str, TensorHeader] = {}
    for f in files:
        try:
            out.update(_read_header(f))
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{what} weights {str(f)!r} are not a valid safetensors file: {e}") from e
    return out


def check_safetensors(path: Path, what: str = "model") -> None:
    """Every *.safetensors file has a readable header that fits the file (catches truncated or corrupt files)."""
    safetensors_headers(path, what)


def extra_layer_prefixes(config: Dict[str, Any]) -> Tuple[str, ...]:
    """Tensor-name prefixes of decoder layers a checkpoint stores past its model's own: DeepSeek-style
    multi-token-prediction layers, ``model.layers.{num_hidden_layers + k}.`` for k below the config's
    ``num_nextn_predict_layers`` (read from ``text_config`` where the checkpoint nests it)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    extra = int(text.get("num_nextn_predict_layers") or config.get("num_nextn_predict_layers") or 0)
    layers = text.get("num_hidden_layers")
    if extra <= 0 or layers is None:
        return ()
    return tuple(f"model.layers.{int(layers) + k}." for k in range(extra))


def load_target(path: Path, config: Dict[str, Any]) -> Tuple[Any, Any]:
    """``mlx_lm.load`` of a target checkpoint, leaving out the tensors of its extra prediction layers
    (``extra_layer_prefixes``): mlx-lm's deepseek_v3 ``sanitize`` drops only ``model.layers.61``, so a
    checkpoint of another depth with its nextn layer fails to load ("parameters not in model").

    Without such tensors this is ``mlx_lm.load`` itself. With them, the model is built through
    ``mlx_lm.utils.load_model``'s ``get_model_classes`` argument: the model object gets its own
    ``sanitize`` (an attribute of that one object, removed after loading) that drops those tensors
    and then runs the class's. Nothing of mlx-lm is changed; the model keeps its class.
    """
    from mlx_lm import load as mlx_load

    prefixes = extra_layer_prefixes(config)
    if not prefixes or not any(name.startswith(prefixes) for name in safetensors_headers(path, "model", required=False)):
        return mlx_load(str(path))
    from mlx_lm.utils import _get_classes, load_model, load_tokenizer

    def classes(config: Dict[str, Any]) -> Tuple[Any, Any]:
        model_class, args_class = _get_classes(config)

        def build(args: Any) -> Any:
            model = model_class(args)
            own = getattr(model, "sanitize", None)

            def sanitize(weights: Dict[str, Any]) -> Dict[str, Any]:
                kept = {k: v for k, v in weights.items() if not k.startswith(prefixes)}
                return own(kept) if own is not None else kept

            model.sanitize = sanitize  # this object only, until loaded
            return model

        return build, args_class

    model, loaded = load_model(path, get_model_classes=classes)
    model.__dict__.pop("sanitize", None)
    tokenizer = load_tokenizer(path, eos_token_ids=loaded.get("eos_token_id", None))
    return model, tokenizer
