"""Loading MiniMax-M3 weights from the layouts found in the wild into ``MiniMaxM3ForCausalLM``.

Every layout goes through transformers' own loader, so every ``from_pretrained`` argument works for each (``dtype``,
``device_map`` with CPU and disk offload, ``max_memory``, ``offload_folder``, ``low_cpu_mem_usage``,
``key_mapping``, config overrides, Hub ids):

* this package's ``save_pretrained`` output (``model_type: minimax_m3``);
* the official release: a ``minimax_m3_vl`` config with a ``text_config`` (``configuration_minimax_m3.
  text_config_dict`` folds it), keys prefixed ``language_model.``, vision tower, projector and ``mtp.`` keys ignored;
* the MXFP8 release (``quantization_config.quant_method == "mxfp8"``): e4m3 weights with a uint8 E8M0
  ``weight_scale_inv`` per 1x32 input block, dequantised at load by transformers' FineGrainedFP8 quantizer;
* transformers' native ``MiniMaxM3VLForCausalLM.save_pretrained`` output (``minimax_m3_vl_text``).

The renames, the expert packing and the native layout's fused projections are the conversion mapping in
``conversion.py``. This module adds what transformers' loader does not check.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

__all__ = ["check_no_duplicate_tensors", "check_quantization_served", "load_model"]


def _shard_files(path: str) -> list:
    """The checkpoint's safetensors files: the index's shards, or the single ``model.safetensors``."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        return ["model.safetensors"]
    with open(index_path) as handle:
        return sorted(set(json.load(handle)["weight_map"].values()))


def check_no_duplicate_tensors(path: str) -> None:
    """Raise when a tensor is stored in two shards of the checkpoint (only the headers are read): an index names one
    file, and which copy a loader would take is an accident of the file order."""
    from safetensors import safe_open

    file_of: Dict[str, str] = {}
    for name in _shard_files(path):
        if not os.path.exists(os.path.join(path, name)):
            continue  # transformers names the missing shard
        with safe_open(os.path.join(path, name), framework="pt") as handle:
            for key in handle.keys():
                if key in file_of:
                    raise ValueError(f"checkpoint at {path}: tensor {key} is in both {file_of[key]} and {name}")
                file_of[key] = name


HUB_ARGUMENTS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "proxies", "subfolder")
"""``from_pretrained`` arguments that say where a Hub checkpoint comes from."""

FP8_METHODS = ("fp8", "mxfp8")


def check_quantization_served(quantization_config) -> None:
    """FP8 checkpoints load dequantised: the model has no FP8 linear or experts kernels, and transformers' FP8
    layers would replace its modules. Raise for an FP8 ``quantization_config`` that asks to keep the weights FP8."""
    if quantization_config is None:
        return
    values = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    if values.get("quant_method") in FP8_METHODS and not values.get("dequantize", False):
        raise ValueError(f"quantization_config {values.get('quant_method')!r} with dequantize=False: MiniMaxM3ForCausalLM "
                         f"runs dequantised weights only; pass dequantize=True (the default this package sets for "
                         f"MXFP8 checkpoints)")


def load_model(path: str, *, config=None, dtype: Optional[torch.dtype] = None, device_map=None):
    """Load any supported layout as ``MiniMaxM3ForCausalLM`` (the Auto-style helper for official directories)."""
    from .configuration_minimax_m3 import MiniMaxM3Config
    from .modeling_minimax_m3 import MiniMaxM3ForCausalLM

    return MiniMaxM3ForCausalLM.from_pretrained(path, config=config or MiniMaxM3Config.from_pretrained(path),
                                                dtype=dtype, device_map=device_map)
