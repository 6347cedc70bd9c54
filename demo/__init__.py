"""The embedded demo: a small llama trained on the Python standard library's source and its drafters
(DFlash, EAGLE-3, an MTP head, a draft LM), made by ``python -m mlx_speculative.demo.build`` (build.py)
and shipped with the package. hooks/loading.py maps the names ``demo``, ``demo-drafter`` (DFlash) and
``demo-<kind>`` to these folders.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
KINDS = ("dflash", "eagle3", "draft_model", "mtp")


def target_dir() -> Path:
    return HERE / "target"


def drafter_dir(kind: str) -> Path:
    return HERE / kind
