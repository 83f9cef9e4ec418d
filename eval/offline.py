"""Keep evaluation off the network: the Hugging Face offline switches, set before ``datasets``/``lm_eval`` load.

``huggingface_hub`` and ``datasets`` read their switches once, at import; ``transformers`` (imported by
``minimax_m3``) has usually imported ``huggingface_hub`` already, so the module-level copies are set too.
"""

from __future__ import annotations

import os
import sys

__all__ = ["OFFLINE_SWITCHES", "enforce_offline"]

OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def enforce_offline() -> None:
    """Set every offline switch (environment and already-imported modules); idempotent."""
    for name in OFFLINE_SWITCHES:
        os.environ[name] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    hub_constants = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None:
        hub_constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True
