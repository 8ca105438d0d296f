"""``tidal``'s layers: the measured layers' artifact (its file name per model and format version,
written by ``kvpress calibrate tidal``, `kvpress.evals.tidal_layers`, and read here) and the choice
and checks of the selection and re-selection layers for a model (`selection_layers`, `check_layers`)."""

from __future__ import annotations

import functools
import re
import warnings

from kvpress.registry import MAX_LAYERS, check_int

ARTIFACT_VERSION = 2  # 2: layers = [selection, reselection] both measured (1 measured the re-selection only)
CALIBRATE_COMMAND = "kvpress calibrate tidal --model MODEL"
DEFAULT_SELECTION_LAYER = 2  # the paper's choice, used for a model without a measurement


def artifact_name(model_id: str) -> str:
    """File name under ``policies/artifacts/`` of the measured layers of ``model_id``."""
    # the last path part that is not kvpress' "tf-<version>" conversion folder, e.g. both
    # "HuggingFaceTB/SmolLM2-135M-Instruct" and "~/.cache/kvpress/smollm2-135m-instruct/tf-5.23.0-x"
    from kvpress.calibration import portable_model_id

    parts = [p for p in portable_model_id(str(model_id)).replace("\\", "/").split("/") if p and not p.startswith("tf-")]
    key = re.sub(r"[^a-z0-9]+", "-", (parts[-1] if parts else "").lower()).strip("-") or "model"
    return f"tidal-{key}.safetensors"


@functools.lru_cache(maxsize=16)
def measured_layers(model_id: str, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, int] | None:
    """``(selection, reselection)`` measured by ``kvpress calibrate tidal`` for this model, or None.

    ``reselection`` is -1 when the measurement found no re-selection layer worth its cost.
    """
    from kvpress.calibration import load_artifact, shipped_artifact

    path = shipped_artifact(artifact_name(model_id))
    if not path.is_file():
        return None
    tensors, meta = load_artifact(path, policy="tidal", version=ARTIFACT_VERSION, required=("layers",))
    if (meta.get("num_layers"), meta.get("num_kv_heads"), meta.get("head_dim")) != (
            str(num_layers), str(num_kv_heads), str(head_dim)):
        return None  # same name, another model shape
    selection, reselection = (int(x) for x in tensors["layers"].tolist())
    if not (0 <= selection < num_layers - 1 and (reselection == -1 or selection < reselection < num_layers)):
        return None
    return selection, reselection


def selection_layers(selection: int | None, reselection: int | None, adapter, warn: bool = True
                     ) -> tuple[int, int | None]:
    """``(selection_layer, reselection_layer)`` of a ``tidal`` policy with these fields for
    ``adapter``'s model (None: no re-selection); the policy's docstring says how they are chosen."""
    measured = measured_layers(adapter.model_id, adapter.num_layers, adapter.num_kv_heads, adapter.head_dim)
    if selection is None:
        selection = measured[0] if measured is not None else DEFAULT_SELECTION_LAYER
        selection = min(selection, adapter.num_layers - 2)  # a tiny model still gets a sparse layer
        selection = _full_layer_from(adapter, selection, fallback=selection)
    if reselection is not None:
        return selection, None if reselection == -1 else reselection
    if measured is not None and measured[0] == selection:
        return selection, None if measured[1] == -1 else measured[1]
    middle = _full_layer_from(adapter, adapter.num_layers // 2, fallback=selection)
    if middle <= selection:
        return selection, None
    if warn:
        warnings.warn(f"tidal: no measured layers for {adapter.model_id!r} with selection layer {selection}; "
                      f"re-selecting at the middle layer {middle} (measure with `{CALIBRATE_COMMAND}`)",
                      stacklevel=4)
    return selection, middle


def check_layers(selection: int | None, reselection: int | None, adapter=None) -> None:
    """ValueError unless the fields ``selection_layer`` / ``reselection_layer`` are in range (any
    model), and with ``adapter``, unless the layers :func:`selection_layers` chooses exist in its
    model and are full-attention layers."""
    if adapter is None:
        if selection is not None:
            check_int("selection_layer", selection, 0, MAX_LAYERS)
        if reselection not in (None, -1):
            check_int("reselection_layer", reselection, 1 if selection is None else selection + 1, MAX_LAYERS)
        return
    if selection is not None:
        check_int("selection_layer", selection, 0, adapter.num_layers - 1)
    selection, reselection = selection_layers(selection, reselection, adapter, warn=False)
    if reselection is not None:
        check_int("reselection_layer", reselection, selection + 1, adapter.num_layers - 1)
    for name, layer in (("selection_layer", selection), ("reselection_layer", reselection)):
        if layer is not None and adapter.sliding_window(layer) is not None:
            raise ValueError(f"{name}={layer} is a sliding-window layer of this model (kept as the model runs "
                             f"it); a selection layer must be a full-attention layer: {list(adapter.policy_layers)}")


def _full_layer_from(adapter, layer: int, *, fallback: int) -> int:
    """The first full-attention layer at or after ``layer`` (sliding-window layers keep the model's
    own attention and cannot select), else ``fallback``."""
    return next((i for i in adapter.policy_layers if i >= layer), fallback)
