"""Drafter families from the entry-point group ``mlx_speculative.drafters``; kind resolution.

Kind resolution never looks at repo names: a drafter checkpoint's config.json decides its family
(each family's ``detect``), and the family decides the kind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..hooks.api import loading
from .base import Compatibility, Drafter, DrafterError, DrafterFamily, DraftTarget

ENTRY_POINT_GROUP = "mlx_speculative.drafters"
log = logging.getLogger("mlx_speculative")

_families: Optional[Dict[str, DrafterFamily]] = None


def families(reload: bool = False) -> Dict[str, DrafterFamily]:
    """Every registered family by name, built-ins included (they are entry points too)."""
    global _families
    if _families is None or reload:
        found: Dict[str, DrafterFamily] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                family = ep.load()
            except Exception as e:  # noqa: BLE001 - a broken third-party package must not break the host
                log.warning("drafter family %r from %s failed to load: %s", ep.name, ep.value, e)
                continue
            if not isinstance(family, DrafterFamily):
                log.warning("entry point %r (%s) is not a DrafterFamily, got %s", ep.name, ep.value, type(family).__name__)
                continue
            family.distribution = ep.dist.name if ep.dist is not None else "?"
            found[family.name] = family
        _families = found
    return _families


def kinds() -> List[str]:
    return sorted({f.kind for f in families().values()})


def weightless_kinds() -> List[str]:
    """Kinds that run without drafter weights (e.g. ngram)."""
    return sorted({f.kind for f in families().values() if not f.needs_weights})


@dataclass
class Resolution:
    family: DrafterFamily
    kind: str
    path: Optional[Path]
    config: Dict[str, Any]
    warnings: List[str]


def ignored_draft_model(kind: str, draft_model: str, kind_source: Optional[str] = None,
                        model_source: Optional[str] = None) -> str:
    """The one line said when an explicit weightless kind overrides a configured draft model."""
    return (f"draft kind {kind!r}{f' ({kind_source})' if kind_source else ''} needs no drafter weights: "
            f"ignoring the draft model {draft_model!r}{f' ({model_source})' if model_source else ''}")


def detect_family(config: Dict[str, Any]) -> Optional[DrafterFamily]:
    matches = [f for f in families().values() if f.needs_weights and f.detect(config)]
    return max(matches, key=lambda f: f.priority) if matches else None


def own_heads(kind: str, target: Optional[DraftTarget]) -> Optional[Resolution]:
    """The target's own checkpoint as its drafter, where a family of ``kind`` finds its heads in the
    target's config (Qwen3.5 ``mtp.*``, DeepSeek-V3's nextn layer); the family's check then reads the tensors."""
    if target is None or target.path is None or not target.config:
        return None
    found = [f for f in families().values() if f.kind == kind and f.in_target and f.detect(target.config)]
    if not found:
        return None
    family = max(found, key=lambda f: f.priority)
    log.info("draft kind %r with no draft model: the %s inside the target's checkpoint %s", kind, family.name, target.path)
    return Resolution(family, kind, Path(target.path), dict(target.config), [])


def _needs_weights(kind: str, target: Optional[DraftTarget]) -> str:
    inside = [f for f in families().values() if f.kind == kind and f.in_target]
    if not inside:
        return f"draft kind {kind!r} needs a draft model (speculative.draft_model / --draft-model)"
    has = ""
    if target is not None:
        got = str(target.config.get("model_type"))
        text = target.config.get("text_config") if isinstance(target.config.get("text_config"), dict) else {}
        if text.get("model_type") and text.get("model_type") != got:
            got += f", text_config {text.get('model_type')}"
        has = f"; the target (model_type {got!r}) has none"
    return (f"draft kind {kind!r} with no draft model needs heads inside the target's own checkpoint{has}; expected: "
            f"{'; or '.join(f.in_target for f in inside)}; allowed: such a target, or a draft model "
            "(speculative.draft_model / --draft-model)")


def resolve(draft_model: Optional[str], kind: str = "auto", target: Optional[DraftTarget] = None) -> Resolution:
    """The family and kind for a drafter checkpoint (or for a weightless kind).

    An explicit kind that needs no weights wins over ``draft_model`` (ignored, with a warning);
    an explicit kind that conflicts with a checkpoint's family loses to the family (warning).
    With no draft model, an explicit kind whose heads the target carries itself uses the target's
    checkpoint (``own_heads``).
    """
    fams = families()
    allowed = ["auto"] + kinds()
    if kind not in allowed:
        raise DrafterError(f"draft kind {kind!r} is not registered; allowed: {', '.join(allowed)}")
    ignored: List[str] = []
    if draft_model is not None and kind in weightless_kinds():
        ignored.append(ignored_draft_model(kind, draft_model))
        draft_model = None
    if draft_model is None:
        if kind == "auto":
            kind = "ngram"
        weightless = [f for f in fams.values() if f.kind == kind and not f.needs_weights]
        if weightless:
            return Resolution(weightless[0], kind, None, {}, ignored)
        own = own_heads(kind, target)
        if own is None:
            raise DrafterError(_needs_weights(kind, target))
        return own
    path = loading.resolve_path(draft_model, "draft model")
    config = loading.read_config(path, "draft model")
    family = detect_family(config)
    if family is None:
        raise DrafterError(
            f"draft model {draft_model!r}: no registered drafter family recognises its config.json "
            f"(model_type={config.get('model_type')!r}, architectures={config.get('architectures')!r}); "
            f"registered families: {', '.join(sorted(fams))}"
        )
    warnings = []
    if kind not in ("auto", family.kind):
        warnings.append(
            f"draft kind {kind!r} conflicts with the drafter's family {family.name!r} (kind "
            f"{family.kind!r}, from its config.json); using {family.kind!r}"
        )
    return Resolution(family, family.kind, path, config, warnings)


def check(resolution: Resolution, target: DraftTarget) -> Compatibility:
    """The family's verdict, plus every safetensors header of the checkpoint (truncated or corrupt
    files make it incompatible before anything loads; a folder with no weight files at all is a
    config-only check, said in the notes, and loading refuses it)."""
    verdict = resolution.family.check(resolution.path, resolution.config, target)
    if resolution.path is not None:
        try:
            headers = loading.safetensors_headers(resolution.path, "draft model", required=False)
        except loading.CheckpointError as e:
            verdict.fail(str(e))
        else:
            verdict.notes.append(describe_headers(headers))
    return verdict


def describe_headers(headers: Dict[str, loading.TensorHeader]) -> str:
    if not headers:
        return "safetensors: no weight files (only config.json and the tokenizer files were checked)"
    files = len({h.file for h in headers.values()})
    return f"safetensors: {len(headers)} tensor headers in {files} file(s), sizes consistent"


def load(resolution: Resolution, target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    verdict = check(resolution, target)
    if not verdict.ok:
        raise DrafterError(f"{resolution.family.name} drafter is incompatible with the target: " + "; ".join(verdict.reasons))
    if resolution.path is not None:
        loading.check_safetensors(resolution.path, "draft model")  # no weight files at all: refused here
    return resolution.family.load(resolution.path, resolution.config, target, options)
