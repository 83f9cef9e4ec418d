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
``conversion.py``. This module adds what transformers' loader does not check: ``check_shards`` reads a local
directory's safetensors headers (and the MXFP8 scales) before transformers reads any weight, so that a truncated or
corrupt shard, a tensor of another shape than ``config.json`` gives, missing or NaN (0xFF) scales raise naming the
shard and the tensor instead of an unnamed safetensors error, a report that names no file, or NaN weights.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = ["check_shards", "read_header", "expected_shapes",
           "check_quantization_served", "check_tensor_parallel_split", "load_model"]


FP8_METHODS = ("fp8", "mxfp8")

OFFICIAL_PREFIX = "language_model."
"""The prefix of the official release's text keys (``conversion.OFFICIAL_CONVERSIONS`` removes it at load)."""

SCALE_SUFFIX = "_scale_inv"
E8M0_NAN = 0xFF
"""The E8M0 byte that the OCP MX format defines as NaN (transformers dequantises it to 2^128, an inf)."""

_MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers
_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2": 8, "F8_E5M2FNUZ": 8,
               "F8_E8M0": 8, "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32, "U64": 64,
               "I64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
"""Bits per element of each safetensors dtype."""
_FP8_DTYPES = ("F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ")
_E8M0_DTYPES = ("U8", "F8_E8M0")


def _shard_files(path: str) -> list:
    """The checkpoint's safetensors files: the index's shards, or the single ``model.safetensors``."""
    index = _weight_map(path)
    return ["model.safetensors"] if index is None else sorted(set(index.values()))


def _weight_map(path: str) -> Optional[Dict[str, str]]:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        return None
    with open(index_path) as handle:
        return json.load(handle)["weight_map"]


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors header: its dtype, shape and data bytes ``[start, end)`` from the file start."""

    file: str
    key: str
    dtype: str
    shape: Tuple[int, ...]
    start: int
    end: int


def read_header(file: str, listed: Sequence[str] = ()) -> Dict[str, HeaderEntry]:
    """The tensors that safetensors file ``file`` lists, checked against its size so that a truncated or corrupt
    file is named with its first bad tensor (safetensors' own error names neither); only the header is read.
    ``listed``: the tensors an index puts in the file, which name it when its header cannot be read."""
    size = os.path.getsize(file)
    lost = f" ({sorted(listed)[0]} and {len(listed) - 1} more that the index lists in it)" if listed else ""
    try:
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            if length is None or length > _MAX_HEADER_BYTES or 8 + length > size:
                raise ValueError(f"{file}: the file has {size} bytes, fewer than its safetensors header needs, so "
                                 f"none of its tensors{lost} can be read; the shard is truncated, re-download it")
            raw = handle.read(length)
    except OSError as error:
        raise OSError(f"{file}: reading the safetensors header failed ({error}); check the file system and "
                      f"re-download the shard if it is damaged") from error
    try:
        header = json.loads(raw)
        entries = [HeaderEntry(file, key, info["dtype"], tuple(int(n) for n in info["shape"]),
                               8 + length + int(info["data_offsets"][0]), 8 + length + int(info["data_offsets"][1]))
                   for key, info in header.items() if key != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ValueError(f"{file}: the safetensors header is not valid ({error}), so none of its tensors{lost} can "
                         f"be read; the shard is corrupt, re-download it") from error
    entries.sort(key=lambda entry: entry.start)
    cut_off = [entry for entry in entries if entry.end > size]
    if cut_off:
        raise ValueError(f"{file}: tensor {cut_off[0].key}: its data ends at byte {cut_off[0].end} but the file "
                         f"has {size} bytes ({len(cut_off)} of its {len(entries)} tensors cut off); the shard "
                         f"is truncated, re-download it")
    position = 8 + length
    for entry in entries:
        bits = _DTYPE_BITS.get(entry.dtype)
        if bits is None:
            raise ValueError(f"{file}: tensor {entry.key}: dtype {entry.dtype} is not a safetensors dtype; the shard "
                             f"is corrupt, re-download it")
        needed = -(-math.prod(entry.shape) * bits // 8)
        if entry.end - entry.start != needed:
            raise ValueError(f"{file}: tensor {entry.key}: {entry.dtype} of shape {list(entry.shape)} takes "
                             f"{needed} bytes but the header gives it {entry.end - entry.start}; the shard is "
                             f"corrupt, re-download it")
        if entry.start != position:  # safetensors refuses gaps and overlaps between tensors' data
            raise ValueError(f"{file}: tensor {entry.key}: its data starts at byte {entry.start}, not where the "
                             f"previous tensor's ends ({position}); the shard is corrupt, re-download it")
        position = entry.end
    if position != size:
        raise ValueError(f"{file}: {size - position} bytes follow the data of its last tensor "
                         f"{entries[-1].key if entries else '(none)'}, which safetensors refuses; the shard is "
                         f"corrupt, re-download it")
    return {entry.key: entry for entry in entries}


def expected_shapes(config) -> Dict[str, Tuple[int, ...]]:
    """The shape of every tensor ``config``'s model loads, under the checkpoint's names (per-expert ``w1`` / ``w3``
    / ``w2``, ``conversion.checkpoint_state_dict``) and the model's own (packed experts), from a meta-device model."""
    from .conversion import checkpoint_state_dict
    from .modeling_minimax_m3 import MiniMaxM3ForCausalLM

    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    shapes.update((name, tuple(tensor.shape)) for name, tensor in checkpoint_state_dict(model).items())
    return shapes


def _fp8_values(config) -> Optional[dict]:
    """``config``'s FP8 ``quantization_config`` as a dict, or None for a checkpoint without FP8 weights."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    values = quantization if isinstance(quantization, dict) else quantization.to_dict()
    return values if values.get("quant_method") in FP8_METHODS else None


def check_shards(path: str) -> None:
    """Raise, naming the shard and the tensor, for a checkpoint directory that cannot load as its ``config.json``
    says, before transformers reads any weight: a truncated or corrupt shard, a tensor stored twice or missing from
    the shard its index names, a tensor of another shape than the config's model, an FP8 weight without scales or
    with scales of another shape, and an E8M0 scale byte 0xFF (NaN). Only the headers and the scale tensors (1/32 of
    the FP8 weights' bytes) are read."""
    weight_map = _weight_map(path) or {}
    listed: Dict[str, list] = {}
    for key, name in weight_map.items():
        listed.setdefault(name, []).append(key)
    files = [name for name in _shard_files(path) if os.path.exists(os.path.join(path, name))]  # transformers names a missing shard
    headers = {name: read_header(os.path.join(path, name), listed.get(name, ())) for name in files}
    entries: Dict[str, HeaderEntry] = {}
    for name, header in headers.items():
        for key, entry in header.items():
            if key in entries:  # an index names one file, and which copy a loader would take is an accident of the file order
                raise ValueError(f"checkpoint at {path}: tensor {key} is in both {os.path.basename(entries[key].file)} "
                                 f"and {name}; remove one copy and its entry in the index")
            entries[key] = entry
    for key, name in sorted(weight_map.items()):
        if name in headers and key not in headers[name]:
            raise ValueError(f"{os.path.join(path, name)}: tensor {key}: model.safetensors.index.json lists it in "
                             f"this shard but the shard lacks it; the checkpoint is incomplete, re-download the shard")
    if not os.path.exists(os.path.join(path, "config.json")):
        return  # nothing says what the shapes should be: transformers checks them against the model it builds
    from .configuration_minimax_m3 import MiniMaxM3Config

    config = MiniMaxM3Config.from_pretrained(path)
    shapes = expected_shapes(config)
    for key, entry in entries.items():
        name = key[len(OFFICIAL_PREFIX):] if key.startswith(OFFICIAL_PREFIX) else key
        if name in shapes and entry.shape != shapes[name]:
            raise ValueError(f"{entry.file}: tensor {key}: shape {list(entry.shape)} where the checkpoint's "
                             f"config.json makes it {list(shapes[name])}; the shard is corrupt or from another "
                             f"checkpoint, re-download it")
    quantization = _fp8_values(config)
    if quantization is not None:
        if "weight_block_size" in quantization:
            block = quantization["weight_block_size"]
        else:
            from transformers import FineGrainedFP8Config

            block = FineGrainedFP8Config().weight_block_size  # what transformers reads such a checkpoint with
        _check_scales(entries, None if block is None else tuple(block))


def _check_scales(entries: Dict[str, HeaderEntry], block: Optional[Tuple[int, int]]) -> None:
    """Every FP8 weight has scales in ``block``-sized blocks (None: per-tensor scales, of any shape), and no E8M0
    scale byte is NaN."""
    for key, entry in entries.items():
        if entry.dtype in _FP8_DTYPES and key + SCALE_SUFFIX not in entries:
            # transformers would load the raw e4m3 values as the weight
            raise ValueError(f"{entry.file}: tensor {key}: an FP8 weight without its {key + SCALE_SUFFIX}, so it "
                             f"cannot be dequantised; the checkpoint is incomplete, re-download it")
        weight = entries.get(key[:-len(SCALE_SUFFIX)]) if key.endswith(SCALE_SUFFIX) else None
        if weight is None or block is None:
            continue
        # transformers derives the block from the scales' shape, so other scales would dequantise in other blocks
        grid = weight.shape[:-2] + tuple(-(-size // step) for size, step in zip(weight.shape[-2:], block))
        if len(weight.shape) < 2 or entry.shape != grid:
            raise ValueError(f"{entry.file}: tensor {key}: shape {list(entry.shape)} where its weight of shape "
                             f"{list(weight.shape)} in {block[0]}x{block[1]} blocks needs {list(grid)}; the shard is "
                             f"corrupt, re-download it")
    scales = sorted((entry for key, entry in entries.items()
                     if key.endswith(SCALE_SUFFIX) and entry.dtype in _E8M0_DTYPES), key=lambda e: (e.file, e.start))
    handle, opened = None, None
    try:
        for entry in scales:
            if entry.file != opened:
                if handle is not None:
                    handle.close()
                handle, opened = open(entry.file, "rb"), entry.file
            handle.seek(entry.start)
            data = handle.read(entry.end - entry.start)
            nan = data.count(E8M0_NAN)
            if nan:
                raise ValueError(f"{entry.file}: tensor {entry.key}: {nan} of its {len(data)} E8M0 scale bytes are "
                                 f"0xFF, which the OCP MX format defines as NaN; the checkpoint is corrupt, "
                                 f"re-download it")
    finally:
        if handle is not None:
            handle.close()




HUB_ARGUMENTS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "proxies", "subfolder")
"""``from_pretrained`` arguments that say where a Hub checkpoint comes from."""


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


def check_tensor_parallel_split(config, quantization_config, tp_size: int) -> None:
    """Raise, naming the field, for a tensor-parallel split of ``tp_size`` ranks that cannot work: each rank must
    hold whole KV groups, and the row-wise splits (the input columns of o_proj and of the down projections of the
    MLPs the layers have) must be even; a block-quantised checkpoint dequantises each rank's share with its own
    scales, so every share must also hold whole scale blocks (transformers would dequantise misaligned ones)."""
    if tp_size <= 1:
        return
    if config.num_key_value_heads % tp_size:
        raise ValueError(f"num_key_value_heads = {config.num_key_value_heads} must be a multiple of the {tp_size} "
                         f"tensor-parallel ranks: each rank holds whole KV groups and their index heads")
    widths = {"num_attention_heads * head_dim (o_proj)": config.num_attention_heads * config.head_dim}
    from .configuration_minimax_m3 import DENSE_MLP, MOE_MLP

    if DENSE_MLP in config.mlp_layer_types:
        widths["dense_intermediate_size"] = config.dense_intermediate_size
    if MOE_MLP in config.mlp_layer_types:
        widths["intermediate_size"] = config.intermediate_size
        widths["shared_intermediate_size * n_shared_experts"] = config.shared_intermediate_size * config.n_shared_experts
    for name, width in widths.items():
        if width % tp_size:
            raise ValueError(f"{name} = {width} does not split among {tp_size} tensor-parallel ranks")
    if quantization_config is None:
        return
    values = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    block = (values.get("weight_block_size") or [1, 1])[-1]
    for name, width in widths.items():
        if (width // tp_size) % block:
            raise ValueError(f"{name} = {width} split among {tp_size} tensor-parallel ranks gives {width // tp_size} "
                             f"columns each, not a multiple of the checkpoint's scale block of {block}: each rank "
                             f"must dequantise whole blocks")
