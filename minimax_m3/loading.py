"""Loading MiniMax-M3 weights from the layouts found in the wild into ``MiniMaxM3ForCausalLM``.

* this package's ``save_pretrained`` output (``model_type: minimax_m3``): transformers' loader, unchanged;
* the official release: a ``minimax_m3_vl`` config with a ``text_config``, safetensors shards with an index and
  keys prefixed ``language_model.`` (vision tower, projector and ``mtp.`` keys are skipped): transformers' loader,
  through the conversions registered in ``conversion.py`` (``load_converted`` reads it too, for MXFP8);
* the MXFP8 release (``quantization_config.quant_method == "mxfp8"``): e4m3 weights with a uint8 E8M0
  ``weight_scale_inv`` per 1x32 input block, dequantised at load as ``W = fp8 * 2^(s - 127)``;
* transformers' native ``MiniMaxM3VLForCausalLM.save_pretrained`` output (``minimax_m3_vl_text``): its
  ``self_attn.indexer.*``, ``mlp.gate.*`` and fused dense ``gate_up_proj`` names are converted to the checkpoint's.

The model holds the routed experts packed (``experts.gate_up_proj`` / ``down_proj``, transformers' experts layout):
the per-expert ``w1`` / ``w3`` / ``w2`` of the official layouts are packed as they stream in.

The router gate and its bias stay fp32 whatever ``dtype`` is asked for.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ["checkpoint_layout", "check_no_duplicate_tensors", "iter_checkpoint_tensors", "convert_to_model_names",
           "dequantize_mxfp8", "load_model"]

logger = logging.getLogger(__name__)

_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
                     "model.multi_modal_projector.")
_FP32_SUFFIXES = ("block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias")


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as handle:
        return json.load(handle)


def checkpoint_layout(path: str) -> str:
    """``"ours"``, ``"official"`` (composite VL) or ``"native"`` (transformers' minimax_m3_vl_text)."""
    model_type = _read_config(path).get("model_type")
    if model_type == "minimax_m3_vl":
        return "official"
    if model_type == "minimax_m3_vl_text":
        return "native"
    return "ours"


def is_mxfp8(path: str) -> bool:
    config = _read_config(path)
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    return quantization.get("quant_method") == "mxfp8"


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
        with safe_open(os.path.join(path, name), framework="pt") as handle:
            for key in handle.keys():
                if key in file_of:
                    raise ValueError(f"checkpoint at {path}: tensor {key} is in both {file_of[key]} and {name}")
                file_of[key] = name


def iter_checkpoint_tensors(path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files, after checking that none is stored twice."""
    from safetensors import safe_open

    check_no_duplicate_tensors(path)
    for name in _shard_files(path):
        with safe_open(os.path.join(path, name), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def dequantize_mxfp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``W = fp8 * 2^(s - 127)`` with one uint8 E8M0 exponent ``s`` per 1x32 block of the input dimension."""
    if weight.dtype != torch.float8_e4m3fn or scale_inv.dtype != torch.uint8:
        raise ValueError(f"MXFP8 weights must be e4m3 with uint8 scales, got {weight.dtype} and {scale_inv.dtype}")
    out_features, in_features = weight.shape
    if scale_inv.shape != (out_features, -(-in_features // 32)):
        raise ValueError(f"weight_scale_inv must be [{out_features}, {-(-in_features // 32)}], got {tuple(scale_inv.shape)}")
    exponents = scale_inv.to(torch.int32).repeat_interleave(32, dim=1)[:, :in_features] - 127
    return weight.to(torch.float32) * torch.pow(2.0, exponents.to(torch.float32))


def _strip_and_filter(key: str) -> Optional[str]:
    if key.startswith("language_model."):
        key = key[len("language_model."):]
    if key.startswith(_SKIPPED_PREFIXES) or key.startswith("mtp.") or ".mtp." in key:
        return None
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model."):]
    return key


def convert_to_model_names(tensors: Iterator[Tuple[str, torch.Tensor]], config) -> Iterator[Tuple[str, torch.Tensor]]:
    """Stream any supported layout's tensors as ``(model parameter name, tensor)``, MXFP8 dequantised.

    Only an e4m3 weight whose scale has not been read yet (or the reverse) is held back, so a checkpoint streams
    through with about one shard in memory.
    """
    pending_scales: Dict[str, torch.Tensor] = {}
    pending_weights: Dict[str, torch.Tensor] = {}
    for raw_key, tensor in tensors:
        key = _strip_and_filter(raw_key)
        if key is None:
            continue
        if key.endswith(".weight_scale_inv"):
            weight_key = key[: -len("_scale_inv")]
            if weight_key in pending_weights:
                yield from _convert_native(weight_key, dequantize_mxfp8(pending_weights.pop(weight_key), tensor), config)
            else:
                pending_scales[weight_key] = tensor
            continue
        if tensor.dtype == torch.float8_e4m3fn and key.endswith(".weight"):
            if key in pending_scales:
                yield from _convert_native(key, dequantize_mxfp8(tensor, pending_scales.pop(key)), config)
            else:
                pending_weights[key] = tensor
            continue
        yield from _convert_native(key, tensor, config)
    if pending_weights:
        raise ValueError(f"e4m3 weights without weight_scale_inv in the checkpoint: {sorted(pending_weights)[:4]}")
    if pending_scales:
        raise ValueError(f"scales without weights in the checkpoint: {sorted(pending_scales)[:4]}")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _convert_native(key: str, tensor: torch.Tensor, config):
    """transformers-native names -> checkpoint names (a no-op for keys already in checkpoint form)."""
    match = _LAYER.match(key)
    if not match:
        return [(key, tensor)]
    layer, rest = match.group(1), match.group(2)
    prefix = f"model.layers.{layer}."
    indexer = re.match(r"^self_attn\.indexer\.(q|k)_(proj|norm)\.weight$", rest)
    if indexer:
        return [(f"{prefix}self_attn.index_{indexer.group(1)}_{indexer.group(2)}.weight", tensor)]
    if rest == "mlp.gate_up_proj.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{prefix}mlp.gate_proj.weight", gate), (f"{prefix}mlp.up_proj.weight", up)]
    if rest == "mlp.gate.weight":
        return [(f"{prefix}block_sparse_moe.gate.weight", tensor)]
    if rest == "mlp.gate.e_score_correction_bias":
        return [(f"{prefix}block_sparse_moe.e_score_correction_bias", tensor)]
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return [(f"{prefix}block_sparse_moe.{rest[len('mlp.'):]}", tensor)]
    if rest == "mlp.shared_experts.gate_up_proj.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{prefix}block_sparse_moe.shared_experts.gate_proj.weight", gate),
                (f"{prefix}block_sparse_moe.shared_experts.up_proj.weight", up)]
    if rest == "mlp.shared_experts.down_proj.weight":
        return [(f"{prefix}block_sparse_moe.shared_experts.down_proj.weight", tensor)]
    return [(key, tensor)]


def load_model(path: str, *, config=None, dtype: Optional[torch.dtype] = None, device_map=None):
    """Load any supported layout as ``MiniMaxM3ForCausalLM`` (the Auto-style helper for official directories)."""
    from .configuration_minimax_m3 import MiniMaxM3Config
    from .modeling_minimax_m3 import MiniMaxM3ForCausalLM

    return MiniMaxM3ForCausalLM.from_pretrained(path, config=config or MiniMaxM3Config.from_pretrained(path),
                                                dtype=dtype, device_map=device_map)


def _transformers_loads(directory: str) -> bool:
    """Our own layout and the official one (through the registered conversion mapping) load with transformers'
    loader; MXFP8 and transformers' native layout with ``load_converted``."""
    return checkpoint_layout(directory) in ("ours", "official") and not is_mxfp8(directory)


HUB_ARGUMENTS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "proxies", "subfolder")
"""``from_pretrained`` arguments that say where a Hub checkpoint comes from."""


def converted_checkpoint_directory(name: str, kwargs: dict) -> Optional[str]:
    """The local directory of a checkpoint in a converted layout (official, MXFP8, transformers-native), or None for
    our own layout (transformers' loader reads it). A Hub id resolves through the Hugging Face cache the way
    transformers resolves it (downloading what is missing unless offline), so a Hub id and a local directory take
    the same path; the Hub arguments are taken out of ``kwargs``."""
    from transformers.utils.hub import cached_file

    if os.path.isdir(name):
        directory = os.path.join(name, kwargs["subfolder"]) if kwargs.get("subfolder") else name
    else:
        hub = {key: kwargs[key] for key in HUB_ARGUMENTS if key in kwargs}
        config_file = cached_file(name, "config.json", **hub)
        directory = os.path.dirname(config_file)
        if _transformers_loads(directory):
            return None
        index = cached_file(name, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False, **hub)
        if index is None:
            cached_file(name, "model.safetensors", **hub)
        else:
            with open(index) as handle:
                for shard in sorted(set(json.load(handle)["weight_map"].values())):
                    cached_file(name, shard, **hub)
        for key in HUB_ARGUMENTS:
            kwargs.pop(key, None)
        return directory
    if _transformers_loads(directory):
        return None
    kwargs.pop("subfolder", None)
    return directory


def load_converted(model_class, path: str, *, config=None, dtype=None, torch_dtype=None, device_map=None,
                   max_memory=None, low_cpu_mem_usage=True, offload_folder=None, offload_state_dict=None,
                   attn_implementation=None, experts_implementation=None, key_mapping=None, trust_remote_code=None,
                   **config_overrides):
    """Build the model on the meta device and stream the converted checkpoint straight to each tensor's device.

    ``low_cpu_mem_usage`` is always the behaviour (about one shard in host memory); ``max_memory`` bounds
    ``device_map="auto"``; disk offload raises (``offload_folder`` / ``offload_state_dict`` only serve it);
    ``key_mapping`` renames checkpoint keys (regex -> replacement, before the layout's own conversion); other
    keywords override config fields (e.g. ``index_dtype="float32"``) and an unknown one raises;
    ``trust_remote_code`` is accepted and changes nothing (no code is loaded from the checkpoint)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import set_module_tensor_to_device

    from .configuration_minimax_m3 import MiniMaxM3Config

    if config is None:
        config, unused = MiniMaxM3Config.from_pretrained(path, return_unused_kwargs=True, **config_overrides)
        if unused:
            raise TypeError(f"unsupported arguments for a converted checkpoint: {sorted(unused)}")
    elif config_overrides:
        raise TypeError(f"pass config overrides {sorted(config_overrides)} or config=, not both")
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    dtype = dtype if dtype is not None else torch_dtype
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if dtype in (None, "auto"):
        dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.float32
    with torch.device("meta"):
        model = model_class(config)
    if device_map is None:
        device_map = {"": "cpu"}
    elif device_map == "auto":
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=model._no_split_modules,
                                           dtype=dtype)
    elif isinstance(device_map, (str, torch.device, int)):
        device_map = {"": device_map}
    expected = set(model.state_dict())
    loaded = set()
    packer = _ExpertPacker(config)
    tensors = iter_checkpoint_tensors(path)
    if key_mapping:
        tensors = ((_mapped_key(key, key_mapping), tensor) for key, tensor in tensors)
    for name, tensor in convert_to_model_names(tensors, config):
        piece = _EXPERT_PIECE.match(name)
        if piece:
            experts = piece.group(1)
            if f"{experts}.gate_up_proj" not in expected:
                raise ValueError(f"checkpoint at {path} has {name}, which the config's model does not")
            target = _device_of(f"{experts}.gate_up_proj", device_map)
            for packed_name, packed in packer.add(name, piece, tensor, dtype, target):
                set_module_tensor_to_device(model, packed_name, target, value=packed, dtype=dtype)
                loaded.add(packed_name)
            continue
        if name not in expected:
            raise ValueError(f"checkpoint at {path} has {name}, which the config's model does not")
        if name in loaded:
            raise ValueError(f"checkpoint at {path} holds {name} twice (under two of its names)")
        target = torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype
        set_module_tensor_to_device(model, name, _device_of(name, device_map), value=tensor.to(target), dtype=target)
        loaded.add(name)
    packer.check_complete(path)
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors of the config's model, e.g. {sorted(missing)[:5]}")
    model.reset_non_persistent_buffers()
    model.eval()
    if len(set(map(str, device_map.values()))) > 1:
        model = dispatch_model(model, device_map=device_map)
    logger.info("loaded %s (%s layout) into MiniMaxM3ForCausalLM", path, checkpoint_layout(path))
    return model


def _mapped_key(key: str, key_mapping: dict) -> str:
    for pattern, replacement in key_mapping.items():
        key = re.sub(pattern, replacement, key)
    return key


_EXPERT_PIECE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


class _ExpertPacker:
    """Packs a layer's per-expert ``w1`` / ``w3`` / ``w2`` into ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``
    on the target device as they stream in (one packed copy in memory, not the pieces as well)."""

    def __init__(self, config):
        self.experts = config.num_local_experts
        self.width = config.intermediate_size
        self.hidden = config.hidden_size
        self.layers = {}  # prefix -> (gate_up, down, names seen)

    def add(self, name, piece, tensor, dtype, device):
        """Copy one piece in; returns the packed ``(name, tensor)`` pairs once the layer is complete."""
        prefix, expert, which = piece.group(1), int(piece.group(2)), piece.group(3)
        if prefix not in self.layers:
            self.layers[prefix] = (
                torch.empty(self.experts, 2 * self.width, self.hidden, dtype=dtype, device=device),
                torch.empty(self.experts, self.hidden, self.width, dtype=dtype, device=device),
                set(),
            )
        gate_up, down, seen = self.layers[prefix]
        if not 0 <= expert < self.experts:
            raise ValueError(f"checkpoint tensor {name}: expert {expert} is outside num_local_experts = {self.experts}")
        if name in seen:
            raise ValueError(f"checkpoint holds {name} twice (under two of its names)")
        rows = {"w1": gate_up[expert, : self.width], "w3": gate_up[expert, self.width:], "w2": down[expert]}[which]
        if tuple(tensor.shape) != tuple(rows.shape):
            raise ValueError(f"checkpoint tensor {name} is {tuple(tensor.shape)}, the config expects {tuple(rows.shape)}")
        rows.copy_(tensor)
        seen.add(name)
        if len(seen) < 3 * self.experts:
            return []
        del self.layers[prefix]
        return [(f"{prefix}.gate_up_proj", gate_up), (f"{prefix}.down_proj", down)]

    def check_complete(self, path: str) -> None:
        for prefix, (_, _, seen) in self.layers.items():
            absent = sorted(f"{prefix}.{e}.{w}.weight" for e in range(self.experts) for w in ("w1", "w2", "w3")
                            if f"{prefix}.{e}.{w}.weight" not in seen)
            raise ValueError(f"checkpoint at {path} lacks {len(absent)} expert tensors, e.g. {absent[:5]}")


def _device_of(name: str, device_map: dict):
    """The device of the longest ``device_map`` prefix covering parameter ``name``."""
    best, device = -1, None
    for prefix, target in device_map.items():
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if len(prefix) > best:
                best, device = len(prefix), target
    if device is None:
        raise ValueError(f"device_map does not place {name}")
    if device == "disk":
        raise ValueError(f"device_map puts {name} on 'disk': disk offload is not supported for converted checkpoints "
                         f"(official, MXFP8, native layouts); save the loaded model with save_pretrained and load that "
                         f"with an offload_folder, or give the device_map / max_memory room on CPU")
    return device
