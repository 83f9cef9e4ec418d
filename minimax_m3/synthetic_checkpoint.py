"""A random checkpoint with the released MiniMax-M3-MXFP8's layout and shapes: ``python -m minimax_m3.synthetic_checkpoint``.

It writes the first layers of the released architecture (by default its 3 dense layers and 2 sparse layers), the real
embedding and untied ``lm_head``, as the MXFP8 release stores them:

* keys under ``language_model.``, named as the release names them (the model's own checkpoint names, per-expert
  ``w1`` / ``w3`` / ``w2``), in safetensors shards of about 5 GB with a ``model.safetensors.index.json``;
* a composite ``minimax_m3_vl`` ``config.json`` whose ``text_config`` is the release's with fewer layers, and whose
  ``quantization_config`` is the release's ``mxfp8`` one (``weight_block_size`` [1, 32], the ``ignored_layers``);
* ``max_position_embeddings`` 1,048,576, as the MXFP8 release's config has;
* e4m3 weights with a uint8 E8M0 ``weight_scale_inv`` per 1x32 input block (``W = fp8 · 2^(s − 127)``) for every
  projection and expert matrix; bf16 embedding, ``lm_head`` and norms; fp32 router gates and routing biases.

Values are random at realistic scales (projections and router of standard deviation ``1/sqrt(fan_in)``, the
embedding 0.02, norm weights and routing biases near 0), drawn from ``--seed`` and each tensor's name, so a seed
always gives the same checkpoint. Tensors are generated and written a block of rows at a time straight into their
place in the shard (the safetensors header is known in advance), so host memory stays bounded by a few blocks
(64 MB of fp32 each) whatever the checkpoint's size. The directory appears under its name only once complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .configuration_minimax_m3 import MiniMaxM3Config

__all__ = ["released_slice_config", "composite_config", "quantize_mxfp8", "checkpoint_tensors",
           "write_synthetic_checkpoint", "main"]

MXFP8_BLOCK = 32
E8M0_BIAS = 127
FP8_E4M3_MAX = 448.0
RELEASE_MAX_POSITION_EMBEDDINGS = 1 << 20
DEFAULT_SHARD_BYTES = 5 * 10**9
BLOCK_ELEMENTS = 1 << 24
"""Elements generated at once (64 MB of fp32): the writer's host-memory bound."""
KEY_PREFIX = "language_model."

_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
                       torch.uint8: "U8"}


def released_slice_config(dense_layers: int = 3, sparse_layers: int = 2, **overrides) -> MiniMaxM3Config:
    """The released text config (``MiniMaxM3Config``'s defaults are the release's) cut to ``dense_layers`` full-
    attention layers with dense MLPs, then ``sparse_layers`` sparse-attention layers with the MoE, at the MXFP8
    release's ``max_position_embeddings``. ``overrides`` change other fields (a small slice for tests)."""
    for name, value in (("dense_layers", dense_layers), ("sparse_layers", sparse_layers)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if dense_layers + sparse_layers < 1:
        raise ValueError("the slice needs at least one layer (dense_layers + sparse_layers >= 1)")
    pattern = [0] * dense_layers + [1] * sparse_layers
    sparse = dict(use_sparse_attention=True, sparse_attention_freq=pattern, sparse_num_index_heads=4,
                  sparse_index_dim=128, sparse_block_size=128, sparse_topk_blocks=16, sparse_init_block=0,
                  sparse_local_block=1, sparse_score_type="max", sparse_disable_index_value=pattern)
    sparse.update(overrides.pop("sparse_attention_config", {}))
    values = dict(num_hidden_layers=len(pattern), moe_layer_freq=pattern, sparse_attention_config=sparse,
                  max_position_embeddings=RELEASE_MAX_POSITION_EMBEDDINGS, rope_theta=5e6, rotary_dim=64,
                  partial_rotary_factor=0.5)
    values.update(overrides)
    return MiniMaxM3Config(**values)


def composite_config(config: MiniMaxM3Config, dtypes: Dict[str, torch.dtype]) -> dict:
    """The release's ``config.json`` around ``config``: ``minimax_m3_vl`` with the text config and the MXFP8
    ``quantization_config`` (the unquantised modules in ``ignored_layers``, as the release lists them)."""
    text = config.to_dict()
    for key in ("transformers_version", "quantization_config", "dtype", "torch_dtype", "tie_word_embeddings"):
        text.pop(key, None)
    text["model_type"] = "minimax_m3"
    text["architectures"] = ["MiniMaxM3SparseForCausalLM"]
    gates = sorted(name[len(KEY_PREFIX):-len(".weight")] for name in dtypes if name.endswith("block_sparse_moe.gate.weight"))
    ignored = ["lm_head", "model.embed_tokens", "vision_tower", "multi_modal_projector", "patch_merge_mlp"] + gates
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "text_config": text,
        "image_token_index": 200025,
        "video_token_index": 200026,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp8", "activation_scheme": "dynamic",
                                "weight_block_size": [1, MXFP8_BLOCK], "ignored_layers": ignored},
    }


def quantize_mxfp8(weight: torch.Tensor):
    """e4m3 values and one E8M0 exponent byte per 1x32 input block: the block's scale is the smallest power of two
    that brings its largest magnitude within e4m3's 448, so ``fp8 · 2^(s − 127)`` represents the block."""
    rows, columns = weight.shape
    if columns % MXFP8_BLOCK:
        raise ValueError(f"an MXFP8 weight needs input columns in blocks of {MXFP8_BLOCK}, got shape {tuple(weight.shape)}")
    blocks = weight.float().view(rows, columns // MXFP8_BLOCK, MXFP8_BLOCK)
    largest = blocks.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(largest / FP8_E4M3_MAX)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks * torch.exp2(-exponent)[..., None]
    return scaled.view(rows, columns).to(torch.float8_e4m3fn), (exponent + E8M0_BIAS).to(torch.uint8)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint: its name, shape, stored dtype and how its values are drawn."""

    name: str
    shape: tuple
    dtype: torch.dtype
    std: float
    quantized: bool  # stored as e4m3 with a ``_scale_inv`` companion

    @property
    def stored_bytes(self) -> int:
        """Bytes of the tensor and, when quantised, its scales."""
        return sum(_entry_bytes(shape, dtype) for _, shape, dtype in _entries(self))

    @property
    def scale_name(self) -> str:
        return self.name + "_scale_inv"

    @property
    def scale_shape(self) -> tuple:
        return (self.shape[0], self.shape[1] // MXFP8_BLOCK)


def checkpoint_tensors(config: MiniMaxM3Config) -> List[TensorSpec]:
    """Every tensor of ``config``'s checkpoint in the release's layout, in layer order: the names and shapes of the
    model's own checkpoint state (``conversion.checkpoint_state_dict`` of a model on the meta device)."""
    from .conversion import checkpoint_state_dict
    from .modeling_minimax_m3 import MiniMaxM3ForCausalLM

    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(config)
    state = checkpoint_state_dict(model)

    def order(name):
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else (-1 if "embed_tokens" in name else 1 << 30)
        return layer, name

    specs = []
    for name in sorted(state, key=order):
        shape = tuple(state[name].shape)
        if name.endswith("e_score_correction_bias"):
            specs.append(TensorSpec(KEY_PREFIX + name, shape, torch.float32, 0.01, False))
        elif len(shape) == 1:  # norms: x̂ · (1 + w), so trained weights sit near 0
            specs.append(TensorSpec(KEY_PREFIX + name, shape, torch.bfloat16, 0.02, False))
        elif name.endswith("block_sparse_moe.gate.weight"):
            specs.append(TensorSpec(KEY_PREFIX + name, shape, torch.float32, shape[1] ** -0.5, False))
        elif name.endswith("embed_tokens.weight"):
            specs.append(TensorSpec(KEY_PREFIX + name, shape, torch.bfloat16, 0.02, False))
        elif name.endswith("lm_head.weight"):
            specs.append(TensorSpec(KEY_PREFIX + name, shape, torch.bfloat16, shape[1] ** -0.5, False))
        elif len(shape) == 2 and name.endswith(".weight"):
            specs.append(TensorSpec(KEY_PREFIX + name, shape, torch.float8_e4m3fn, shape[1] ** -0.5, True))
        else:
            raise ValueError(f"tensor {name} of shape {shape}: no rule for how the release stores it")
    return specs


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _entries(spec: TensorSpec) -> list:
    """(name, shape, dtype) of what ``spec`` stores: the tensor, and its scales when quantised."""
    entries = [(spec.name, spec.shape, spec.dtype)]
    if spec.quantized:
        entries.append((spec.scale_name, spec.scale_shape, torch.uint8))
    return entries


def _entry_bytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _shard_plan(specs: List[TensorSpec], shard_bytes: int) -> List[List[TensorSpec]]:
    """Consecutive tensors (a weight with its scales) grouped into shards of at most ``shard_bytes`` (a larger
    tensor gets a shard of its own)."""
    shards, current, size = [], [], 0
    for spec in specs:
        nbytes = spec.stored_bytes
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _header(shard: List[TensorSpec]):
    """The safetensors header of ``shard`` (8-byte aligned) and each entry's data offset from the file start."""
    entries, offset = {}, 0
    for spec in shard:
        for name, shape, dtype in _entries(spec):
            nbytes = _entry_bytes(shape, dtype)
            entries[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    start = 8 + len(header)
    return struct.pack("<Q", len(header)) + header, {name: start + e["data_offsets"][0] for name, e in entries.items()}


def _write_bytes(handle, offset: int, tensor: torch.Tensor) -> None:
    handle.seek(offset)
    handle.write(tensor.contiguous().cpu().view(torch.uint8).numpy())


def _write_tensor(handle, offsets: dict, spec: TensorSpec, seed: int, device: torch.device) -> None:
    """Draw ``spec`` a block of rows at a time and write each block (and its scales) into its place."""
    generator = torch.Generator(device=device).manual_seed(_seed_of(seed, spec.name))
    rows = spec.shape[0]
    columns = math.prod(spec.shape[1:])
    block_rows = max(1, BLOCK_ELEMENTS // max(1, columns))
    row_bytes = columns * torch.empty((), dtype=spec.dtype).element_size()
    for begin in range(0, rows, block_rows):
        count = min(block_rows, rows - begin)
        values = torch.randn((count, columns), generator=generator, device=device) * spec.std
        if spec.quantized:
            weight, scales = quantize_mxfp8(values)
            _write_bytes(handle, offsets[spec.name] + begin * row_bytes, weight)
            _write_bytes(handle, offsets[spec.scale_name] + begin * (columns // MXFP8_BLOCK), scales)
        else:
            _write_bytes(handle, offsets[spec.name] + begin * row_bytes, values.to(spec.dtype))


def write_synthetic_checkpoint(output, config: MiniMaxM3Config, *, seed: int = 0,
                               shard_bytes: int = DEFAULT_SHARD_BYTES, device=None, overwrite: bool = False,
                               progress=None) -> pathlib.Path:
    """Write ``config``'s checkpoint in the MXFP8 release's layout to the directory ``output`` (see the module
    docstring). It is written under a temporary name beside ``output`` and renamed when complete; an existing
    ``output`` is replaced only with ``overwrite``. ``progress(done_bytes, total_bytes)`` is called per tensor."""
    output = pathlib.Path(output)
    if type(seed) is not int or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if type(shard_bytes) is not int or shard_bytes < 1:
        raise ValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
    if output.exists() and not overwrite:
        raise FileExistsError(f"output {output} exists: pass overwrite=True (--overwrite) to replace it")
    if output.exists() and not output.is_dir():
        raise NotADirectoryError(f"output {output} exists and is not a directory")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    specs = checkpoint_tensors(config)
    shards = _shard_plan(specs, shard_bytes)
    total = sum(spec.stored_bytes for spec in specs)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.", suffix=".partial"))
    try:
        weight_map, done = {}, 0
        for number, shard in enumerate(shards, start=1):
            file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            header, offsets = _header(shard)
            with open(staging / file_name, "wb") as handle:
                handle.write(header)
                for spec in shard:
                    _write_tensor(handle, offsets, spec, seed, device)
                    for name, shape, dtype in _entries(spec):
                        weight_map[name] = file_name
                        done += _entry_bytes(shape, dtype)
                    if progress is not None:
                        progress(done, total)
                handle.flush()
                os.fsync(handle.fileno())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        dtypes = {spec.name: spec.dtype for spec in specs}
        (staging / "config.json").write_text(json.dumps(composite_config(config, dtypes), indent=1))
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGIB")
    unit = stripped[len(number):]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"a size like 5GB or 500MB, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive size, got {text!r}")
    return int(value)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"an integer >= 0, got {text!r}")
    return value


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="the checkpoint directory to write")
    parser.add_argument("--dense-layers", type=_count, default=3, help="full-attention layers with dense MLPs (default 3)")
    parser.add_argument("--sparse-layers", type=_count, default=2, help="sparse-attention MoE layers after them (default 2)")
    parser.add_argument("--seed", type=_count, default=0)
    parser.add_argument("--shard-size", type=_size, default=DEFAULT_SHARD_BYTES, help="bytes per shard (default 5GB)")
    parser.add_argument("--device", default=None, help="where values are drawn (default: cuda if available, else cpu)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    if args.dense_layers + args.sparse_layers < 1:
        parser.error("--dense-layers + --sparse-layers must be >= 1")
    output = pathlib.Path(args.output)
    if output.exists() and not args.overwrite:
        parser.error(f"{output} exists: pass --overwrite to replace it")
    if output.exists() and not output.is_dir():
        parser.error(f"{output} exists and is not a directory")
    device = _checked_device(parser, args.device)
    config = released_slice_config(args.dense_layers, args.sparse_layers)

    def progress(done, total):
        print(f"\r{done / 1e9:6.2f} of {total / 1e9:.2f} GB", end="", file=sys.stderr, flush=True)

    path = write_synthetic_checkpoint(output, config, seed=args.seed, shard_bytes=args.shard_size, device=device,
                                      overwrite=args.overwrite, progress=progress)
    print(file=sys.stderr)
    print(f"wrote {path} ({config.num_hidden_layers} layers)")


def _checked_device(parser, name):
    if name is None:
        return None
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"--device: not a torch device: {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: this machine has no CUDA device")
    return device


if __name__ == "__main__":
    main()
