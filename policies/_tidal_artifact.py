"""Where ``tidal``'s measured layers live: the artifact's file name per model and its format version
(read by ``kvpress.policies.tidal``, written by ``kvpress calibrate tidal``, `kvpress.evals.tidal_layers`)."""

from __future__ import annotations

import re

ARTIFACT_VERSION = 2  # 2: layers = [selection, reselection] both measured (1 measured the re-selection only)


def artifact_name(model_id: str) -> str:
    """File name under ``policies/artifacts/`` of the measured layers of ``model_id``."""
    # the last path part that is not kvpress' "tf-<version>" conversion folder, e.g. both
    # "HuggingFaceTB/SmolLM2-135M-Instruct" and "~/.cache/kvpress/smollm2-135m-instruct/tf-5.23.0-x"
    from kvpress.calibration import portable_model_id

    parts = [p for p in portable_model_id(str(model_id)).replace("\\", "/").split("/") if p and not p.startswith("tf-")]
    key = re.sub(r"[^a-z0-9]+", "-", (parts[-1] if parts else "").lower()).strip("-") or "model"
    return f"tidal-{key}.safetensors"
