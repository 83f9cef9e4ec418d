"""The embedded default model: a tiny MiniMax-M3 and its tokenizer, created deterministically on first use.

``python -m eval`` needs a model on a fresh machine without downloads. This module builds one (random weights
from a fixed seed: the point is sparse vs dense on the same weights, not accuracy) with the real layer mix (one
full-attention layer with a dense MLP, then MiniMax Sparse Attention layers with a small MoE) and a geometry
whose page selection really drops pages at a few hundred tokens (pages of 16 tokens, top-4 pages), plus a
byte-level BPE tokenizer trained with ``tokenizers`` on the bundled public-domain text. Both are saved under the
user cache directory, then loaded like any checkpoint of our ``minimax_m3`` type through
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

Cache location: ``$MINIMAX_M3_EVAL_CACHE``, else ``$XDG_CACHE_HOME/minimax-m3-eval``, else
``~/.cache/minimax-m3-eval``; the directory name carries ``VERSION`` (bump it when anything here changes the
files). Creation writes into a temporary directory and renames it into place, so concurrent first uses are safe.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "VERSION",
    "SEED",
    "cache_root",
    "default_model_dir",
    "tiny_config",
    "build_tokenizer",
    "ensure_default_model",
    "load_default_model",
]

logger = logging.getLogger(__name__)

VERSION = "v2"
SEED = 20261130
VOCAB_SIZE = 512
MAX_POSITIONS = 4096
MODEL_MAX_POSITIONS = 1 << 20  # the throughput runs reach 128K-token contexts; the model checks lengths against it
INITIALIZER_RANGE = 0.1  # q/k are RMS-normed, so attention is peaked enough to make page selection matter
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
PROVENANCE_FILE = "eval_default_model.json"
_PUBLIC_DOMAIN = Path(__file__).resolve().parent / "tasks" / "data" / "public_domain.jsonl"


def cache_root() -> Path:
    if os.environ.get("MINIMAX_M3_EVAL_CACHE"):
        return Path(os.environ["MINIMAX_M3_EVAL_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "minimax-m3-eval"
    return Path.home() / ".cache" / "minimax-m3-eval"


def default_model_dir() -> Path:
    return cache_root() / f"tiny-minimax-m3-{VERSION}"


def tiny_config(vocab_size: int = VOCAB_SIZE):
    """1 full-attention + dense-MLP layer, 2 sparse layers with a 4-expert MoE; pages of 16 tokens, top-4."""
    from minimax_m3 import MiniMaxM3Config

    return MiniMaxM3Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rotary_dim=16, intermediate_size=64, dense_intermediate_size=128, shared_intermediate_size=64,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=MODEL_MAX_POSITIONS,
        initializer_range=INITIALIZER_RANGE, moe_layer_freq=[0, 1, 1],
        sparse_attention_config={
            "sparse_attention_freq": [0, 1, 1], "sparse_num_index_heads": 2, "sparse_index_dim": 32,
            "sparse_block_size": 16, "sparse_topk_blocks": 4, "sparse_init_block": 0, "sparse_local_block": 1,
        },
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def _training_texts() -> list:
    with open(_PUBLIC_DOMAIN, encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


def build_tokenizer(extra_texts: Sequence[str] = (), *, vocab_size: int = VOCAB_SIZE, individual_digits: bool = False,
                    model_max_length: int = MAX_POSITIONS):
    """A byte-level BPE (``vocab_size`` entries at most, ids 0/1/2 = pad/bos/eos) trained on the bundled text and
    ``extra_texts``; with ``individual_digits`` every digit is its own token (numbers are never merged).

    Byte-level, so any text encodes (digits and keys of the retrieval task included); training on a fixed corpus
    with a fixed vocabulary size is deterministic. The defaults build the embedded default model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if individual_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2, show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts() + list(extra_texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=model_max_length,
    )


def _initialise(model) -> None:
    """Weights from our own generator in parameter-name order: independent of transformers' init order."""
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):  # Gemma RMSNorm stores the offset from 1
                parameter.zero_()
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * INITIALIZER_RANGE)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()


def _write(directory: Path) -> None:
    from minimax_m3 import MiniMaxM3ForCausalLM

    tokenizer = build_tokenizer()
    if len(tokenizer) != VOCAB_SIZE or tokenizer.convert_tokens_to_ids([PAD, BOS, EOS]) != [0, 1, 2]:
        raise RuntimeError(f"the trained tokenizer has {len(tokenizer)} entries and special ids "
                           f"{tokenizer.convert_tokens_to_ids([PAD, BOS, EOS])}; expected {VOCAB_SIZE} and [0, 1, 2]")
    model = MiniMaxM3ForCausalLM(tiny_config(len(tokenizer))).float()
    _initialise(model)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    provenance = {"version": VERSION, "seed": SEED, "vocab_size": VOCAB_SIZE, "initializer_range": INITIALIZER_RANGE,
                  "tokenizer_corpus": str(_PUBLIC_DOMAIN.relative_to(_PUBLIC_DOMAIN.parents[3])),
                  "note": "random weights: for comparing sparse and dense attention, not for accuracy"}
    (directory / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=1) + "\n")


def ensure_default_model(directory: Optional[Path] = None) -> Path:
    """The default model's directory, created on first use (atomically: temp directory + rename)."""
    final = Path(directory) if directory is not None else default_model_dir()
    if (final / PROVENANCE_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    logger.warning("creating the embedded default model (tiny MiniMax-M3, seed %d) at %s", SEED, final)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _write(staging)
        try:
            os.rename(staging, final)
        except OSError:
            # another process renamed its copy into place first: theirs is as good as ours
            if not (final / PROVENANCE_FILE).is_file():
                raise RuntimeError(f"{final} exists but is not a complete default model; remove it and retry") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def load_default_model(*, dtype: torch.dtype = torch.float32, device: str = "cpu",
                       directory: Optional[Path] = None) -> Tuple[object, object]:
    """``(model, tokenizer)`` of the default model (created if missing) through the Auto classes."""
    import minimax_m3  # noqa: F401  (registers the minimax_m3 model type with the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_default_model(directory)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
