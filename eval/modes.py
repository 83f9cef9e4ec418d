"""The attention modes compared by the evaluations, switched in place on one model (so the weights are the same).

* ``sparse``: MiniMax Sparse Attention, indexer ``backend="auto"`` (the SM90 kernels where they apply);
* ``sparse-torch``: the same with the indexer's exact torch backend (the kernels' contribution is the difference);
* ``dense``: every layer full causal attention (``attention_mode="dense"``), the baseline.

``native`` (transformers' ``MiniMaxM3VLForCausalLM``) is another model, built by ``eval.throughput``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from minimax_m3 import MiniMaxM3Config
from minimax_m3.sparse_attention import PageSelector

__all__ = ["MODE_SETTINGS", "NATIVE_MODE", "ALL_MODES", "set_attention_mode", "attention_mode", "indexer_backends_in_use",
           "forward_over_cache"]

MODE_SETTINGS = {
    "sparse": {"attention_mode": "sparse", "indexer_backend": "auto"},
    "sparse-torch": {"attention_mode": "sparse", "indexer_backend": "torch"},
    "dense": {"attention_mode": "dense"},
}
NATIVE_MODE = "native"
ALL_MODES = (*MODE_SETTINGS, NATIVE_MODE)


def _configs(model) -> list:
    """Every distinct MiniMaxM3Config the model's modules hold (normally one shared object)."""
    found = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, MiniMaxM3Config):
            found[id(config)] = config
    if not found:
        raise TypeError(f"expected a minimax_m3 model (MiniMaxM3ForCausalLM), got {type(model).__name__}")
    return list(found.values())


def set_attention_mode(model, mode: str) -> None:
    """Switch ``model`` (a ``MiniMaxM3ForCausalLM``) to ``mode``, one of ``MODE_SETTINGS``."""
    if mode not in MODE_SETTINGS:
        raise ValueError(f"mode must be one of {tuple(MODE_SETTINGS)}, got {mode!r}")
    configs = _configs(model)
    for config in configs:
        for key, value in MODE_SETTINGS[mode].items():
            setattr(config, key, value)
        config.validate_minimax_m3()
    # The page selector caches an indexer wrapper per device (built with the backend of its time) and a score
    # buffer: a fresh one per mode so neither carries over into the next mode's measurements.
    model.model.page_selector = PageSelector(configs[0])


@contextlib.contextmanager
def attention_mode(model, mode: str) -> Iterator:
    """``set_attention_mode`` for the block; the config's previous values are restored after it."""
    configs = _configs(model)
    keys = {key for settings in MODE_SETTINGS.values() for key in settings}
    saved = [{key: getattr(config, key) for key in keys} for config in configs]
    set_attention_mode(model, mode)
    try:
        yield model
    finally:
        for config, values in zip(configs, saved):
            for key, value in values.items():
                setattr(config, key, value)
        model.model.page_selector = PageSelector(configs[0])


def indexer_backends_in_use(model) -> list:
    """The indexer backends that served the last forward (``"torch"``/``"cute"``), e.g. to show what ``auto``
    resolved to; empty before a sparse forward."""
    selector = getattr(getattr(model, "model", None), "page_selector", None)
    return sorted(selector.indexer_backends()) if selector is not None else []


def forward_over_cache(model, input_ids, state: dict, *, native: bool) -> None:
    """One no-grad forward of new tokens over ``state["cache"]``, keeping the last position's logits. Our model
    extends its cache in place; transformers' native model (``native``) returns its cache, which replaces the
    state's (``None`` there starts a new one)."""
    import torch

    from minimax_m3.modeling_minimax_m3 import CACHE_FIELD

    with torch.no_grad():
        if native:
            output = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: state["cache"]})
            state["cache"] = getattr(output, CACHE_FIELD)
        else:
            model(input_ids=input_ids, past_key_values=state["cache"], use_cache=True, logits_to_keep=1)
