"""Dense causal attention of MiniMax-M3's full-attention layers (and of every layer in dense mode), dispatched through
transformers' ``AttentionInterface`` by ``config._attn_implementation``.

Both implementations served here are GQA-native: the 4 KV heads are never repeated to the 64 query heads (that
repeat cost 2 x 3.2 ms per dense layer for a 2K-token chunk over 128K on the H200).

* ``sdpa`` (default): ``scaled_dot_product_attention`` with ``enable_gqa``. A fresh prefill uses SDPA's own causal
  mode; new tokens over a cached prefix use a bottom-right causal bias (no mask tensor on CUDA: SDPA's flash kernel
  aligns it); a single new token attends to everything without a mask. A decode step of every sequence on CUDA
  (one token each, fp16/bf16) runs flash-decoding instead (``decode_attention``). A chunk of new tokens over a
  long cached prefix on CUDA (inference, fp16/bf16, a wave of query tiles) runs the prefix's whole blocks of
  ``PREFIX_KEY_BLOCK`` keys through cuDNN and the rest through FlashAttention-2, merged by their log-sum-exps
  (``split_prefix_attention``): cuDNN runs at about twice FlashAttention-2's rate on Hopper, and fixed-size blocks
  let it build one plan for every prefix length (a plan costs about 40 ms of host time; docs/PERFORMANCE.md).
* ``eager``: the explicit softmax in fp32, grouped by KV head (the reference).
* A function a user registers with ``transformers.AttentionInterface.register(name, fn)`` is called with
  transformers' signature: ``query [1, H, q, D]``, ``key`` / ``value [1, KV, kv, D]`` (not repeated), and for new
  tokens over a cached prefix a boolean ``attention_mask [1, 1, q, kv]`` (True: attend), else ``None`` with
  ``is_causal=True``.

transformers' flash-attention, flex-attention and paged implementations expect its own mask and cache layouts, not
this model's packed sequences and positional cache: they raise (``check_served``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from .decode_attention import flash_decode, flash_decode_supported
from .split_kv import merge_two_splits

__all__ = ["ALL_ATTENTION_FUNCTIONS", "SERVED", "check_served", "dense_attention", "decode_step_attention",
           "eager_attention_forward",
           "sdpa_attention_forward", "is_same_length_fresh_prefill", "split_prefix_attention", "split_prefix_serves",
           "PREFIX_KEY_BLOCK"]

_MASK_ELEMENTS = 1 << 24
SERVED = ("sdpa", "eager")
"""The implementations this module provides; user-registered functions are served as well."""
_UNSERVED_MARKERS = ("flash", "flex", "paged", "/")


def check_served(implementation: str) -> None:
    """Raise for an ``attn_implementation`` the model cannot run."""
    if implementation in SERVED:
        return
    if any(marker in implementation for marker in _UNSERVED_MARKERS) or implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"attn_implementation={implementation!r} is not served by MiniMax-M3: its dense layers run 'sdpa' (the "
            f"default, GQA-native) or 'eager', or a function registered with transformers.AttentionInterface; the "
            f"flash, flex and paged implementations expect transformers' own mask and cache layouts")


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal: bool = True, **kwargs):
    """GQA-native SDPA; ``is_causal`` aligns the ``q`` queries with the last ``q`` keys (bottom-right), as
    flash-attention does. ``attention_mask`` (boolean, True: attend) replaces the causal rule when given."""
    q_length, kv_length = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if attention_mask is not None:
        mask, causal = attention_mask, False
    elif not is_causal or q_length == 1:
        mask, causal = None, False  # one query at the end sees every key
    elif q_length == kv_length:
        mask, causal = None, True
    elif split_prefix_serves(query, key, dropout):
        return split_prefix_attention(query, key, value, scaling), None
    elif query.is_cuda:
        mask, causal = causal_lower_right(q_length, kv_length), False
    else:
        return _chunked_masked_sdpa(query, key, value, scaling, gqa), None
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling, enable_gqa=gqa)
    return output.transpose(1, 2), None


PREFIX_KEY_BLOCK = 16384
"""Keys per cuDNN call over a cached prefix: every call has one shape, so cuDNN builds its plan once."""
_CUDNN_QUERY_TILE = 128


def split_prefix_serves(query, key, dropout: float) -> bool:
    """Whether ``split_prefix_attention`` serves new tokens over a cached prefix: CUDA inference in fp16/bf16 with
    cuDNN's and flash SDPA enabled, head dims both take, no dropout, at least one whole key block before the new
    tokens, and a query tile (128 queries of one head) for every SM. cuDNN does not split the keys, so fewer tiles
    leave SMs idle: 16 tokens over 128K (64 tiles) took 1.9 ms against FlashAttention-2's 1.0 ms on the H200."""
    batch, heads, q_length, head_dim = query.shape
    if not query.is_cuda or key.shape[2] - q_length < PREFIX_KEY_BLOCK:
        return False
    tiles = batch * heads * -(-q_length // _CUDNN_QUERY_TILE)
    return (tiles >= torch.cuda.get_device_properties(query.device).multi_processor_count
            and query.dtype in (torch.float16, torch.bfloat16) and key.dtype == query.dtype
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
            and not dropout and head_dim % 8 == 0 and head_dim <= 128
            and torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.backends.cuda.flash_sdp_enabled())


def _cudnn_attention(query, key, value, scaling):
    """cuDNN's flash attention without a mask: ``([B, H, q, D], natural log-sum-exp [B, H, q])``."""
    output, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, False, False, scale=scaling)[:2]
    return output, lse.reshape(lse.shape[:3])


def _flash_bottom_right_attention(query, key, value, scaling):
    """FlashAttention-2 with its causal mask, which aligns the queries with the last keys: ``([B, H, q, D],
    natural log-sum-exp [B, H, q])``."""
    return tuple(torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False,
                                                                     scale=scaling)[:2])


def split_prefix_attention(query, key, value, scaling, *, key_block: int = PREFIX_KEY_BLOCK,
                           prefix_attention=_cudnn_attention, causal_attention=_flash_bottom_right_attention):
    """Bottom-right causal attention of ``query [B, H, q, D]`` over ``key`` / ``value [B, KV, kv, D]`` (kv - q >=
    ``key_block``), ``[B, q, H, D]``: the prefix's whole blocks of ``key_block`` keys by ``prefix_attention`` without
    a mask (cuDNN; queries padded to whole tiles, so chunk lengths share plans too), the keys after them, the new
    tokens' own included, by ``causal_attention`` (FlashAttention-2, bottom-right causal), each with its
    log-sum-exp, merged into a running fp32 result one block at a time: memory for two blocks' outputs, whatever
    the prefix length and the chunk."""
    batch, heads, q_length, head_dim = query.shape
    blocks = (key.shape[2] - q_length) // key_block
    padded_length = -(-q_length // _CUDNN_QUERY_TILE) * _CUDNN_QUERY_TILE
    padded = query
    if padded_length != q_length:
        padded = torch.nn.functional.pad(query.transpose(1, 2), (0, 0, 0, 0, 0, padded_length - q_length)).transpose(1, 2)
    rest = slice(blocks * key_block, None)
    output, lse = causal_attention(query, key[:, :, rest], value[:, :, rest], scaling)
    for block in range(blocks):
        keys = slice(block * key_block, (block + 1) * key_block)
        block_output, block_lse = prefix_attention(padded, key[:, :, keys], value[:, :, keys], scaling)
        output, lse = merge_two_splits(output, lse, block_output[:, :, :q_length], block_lse[:, :, :q_length])
    return output.to(query.dtype).transpose(1, 2)


def _chunked_masked_sdpa(query, key, value, scaling, gqa):
    """Bottom-right causal SDPA with explicit ``[chunk, kv]`` masks (CPU), so no ``[q, kv]`` mask is built."""
    q_length, kv_length = query.shape[2], key.shape[2]
    outputs = []
    chunk = max(1, _MASK_ELEMENTS // kv_length)
    for begin in range(0, q_length, chunk):
        end = min(q_length, begin + chunk)
        positions = torch.arange(kv_length - q_length + begin, kv_length - q_length + end, device=query.device)
        allowed = torch.arange(kv_length, device=query.device)[None, :] <= positions[:, None]
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, begin:end], key, value, attn_mask=allowed, scale=scaling, enable_gqa=gqa))
    return torch.cat(outputs, dim=2).transpose(1, 2)


def eager_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: Optional[float] = None, is_causal: bool = True, **kwargs):
    """The explicit softmax in fp32, per KV head over its group of query heads; the same mask rules as
    ``sdpa_attention_forward``."""
    batch, num_heads, q_length, head_dim = query.shape
    num_kv_heads, kv_length = key.shape[1], key.shape[2]
    scaling = head_dim ** -0.5 if scaling is None else scaling
    grouped = query.float().view(batch, num_kv_heads, num_heads // num_kv_heads, q_length, head_dim)
    logits = torch.einsum("bgrqd,bgkd->bgrqk", grouped, key.float()) * scaling
    if attention_mask is not None:
        logits = logits.masked_fill(~attention_mask[:, :, None], float("-inf"))  # [B, 1, q, kv] over the groups
    elif is_causal:
        positions = torch.arange(kv_length - q_length, kv_length, device=query.device)
        future = torch.arange(kv_length, device=query.device)[None, :] > positions[:, None]
        logits = logits.masked_fill(future, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    if dropout and module is not None and module.training:
        probabilities = torch.nn.functional.dropout(probabilities, p=dropout)
    output = torch.einsum("bgrqk,bgkd->bgrqd", probabilities, value.float()).to(query.dtype)
    return output.reshape(batch, num_heads, q_length, head_dim).transpose(1, 2), probabilities.flatten(1, 2)


ALL_ATTENTION_FUNCTIONS = AttentionInterface()
"""transformers' attention interface with this model's ``sdpa`` and ``eager`` as local entries (other models keep
transformers' functions); functions registered globally are found through it too."""
ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
ALL_ATTENTION_FUNCTIONS["eager"] = eager_attention_forward


def dense_attention(q, keys, values, metadata, *, scale: float, attention=sdpa_attention_forward,
                    module=None, dropout: float = 0.0) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens (packed ``q [T, H, D]``) over its cached tokens
    (``keys`` / ``values [B, capacity, KV, D]``, bottom-right aligned), ``[T, H, D]``, by ``attention`` (an
    ``ALL_ATTENTION_FUNCTIONS`` entry).

    Several fresh sequences of one length (a training batch) go through one call over the batch."""
    if metadata.step is not None:
        if attention is sdpa_attention_forward and flash_decode_supported(q, keys):
            return flash_decode(q, keys, values, metadata.step.kv_lengths, scale=scale)
        return decode_step_attention(q, keys, values, metadata.step.kv_lengths, scale=scale, attention=attention,
                                     module=module)
    if (attention is sdpa_attention_forward and len(metadata.query_lengths) == keys.shape[0] == q.shape[0]
            and max(metadata.query_lengths) == 1 and flash_decode_supported(q, keys)):
        # a decode step eagerly: the kernels of the graphed step (SDPA would take cuDNN, which builds a plan per
        # key length)
        return flash_decode(q, keys, values, metadata.device_lengths(q.device)[1], scale=scale)
    local = attention in (sdpa_attention_forward, eager_attention_forward)

    def attend(query, key, value, past: int):
        """``query [B, H, q, D]`` over ``key`` / ``value [B, KV, kv, D]``; the queries are the last q positions."""
        q_length, kv_length = query.shape[2], key.shape[2]
        mask = None
        if past and not local and q_length > 1:
            positions = torch.arange(kv_length - q_length, kv_length, device=query.device)
            mask = (torch.arange(kv_length, device=query.device)[None, :] <= positions[:, None])[None, None]
        output, _ = attention(module, query, key, value, mask, dropout=dropout, scaling=scale,
                              is_causal=mask is None and (past == 0 or local))
        return output  # [B, q, H, D]

    if is_same_length_fresh_prefill(metadata, batch_size=keys.shape[0]) and len(metadata.query_lengths) > 1:
        batch, length = keys.shape[0], metadata.query_lengths[0]
        query = q.view(batch, length, *q.shape[1:]).transpose(1, 2)
        output = attend(query, keys[:, :length].transpose(1, 2), values[:, :length].transpose(1, 2), 0)
        return output.reshape(batch * length, *q.shape[1:])
    output = torch.empty_like(q)
    for sequence, (start, count, kv_length) in enumerate(zip(metadata.query_starts, metadata.query_lengths, metadata.kv_lengths)):
        if count == 0:
            continue
        query = q[start : start + count].transpose(0, 1)[None]  # [1, H, count, D]
        key = keys[sequence, :kv_length].transpose(0, 1)[None]  # [1, KV, kv, D]
        value = values[sequence, :kv_length].transpose(0, 1)[None]
        output[start : start + count] = attend(query, key, value, kv_length - count)[0]
    return output


def decode_step_attention(q, keys, values, kv_lengths, *, scale: float, attention=sdpa_attention_forward,
                          module=None) -> torch.Tensor:
    """One new token per sequence (``q [B, H, D]``) over the whole cache capacity (``keys`` / ``values [B, C, KV,
    D]``) with the keys ``j < kv_lengths[b]`` (device int32 ``[B]``) allowed: no host length, so a CUDA graph can
    replay it at every length. Our ``sdpa`` runs each KV group's query heads as that head's query rows (GQA without
    a repeat or a GQA kernel); other functions get transformers' signature with a ``[B, 1, 1, C]`` boolean mask."""
    batch, capacity, num_kv_heads, head_dim = keys.shape
    allowed = torch.arange(capacity, device=keys.device)[None, :] < kv_lengths.to(keys.device)[:, None]
    key, value = keys.transpose(1, 2), values.transpose(1, 2)  # [B, KV, C, D]
    if attention is sdpa_attention_forward:
        query = q.view(batch, num_kv_heads, q.shape[1] // num_kv_heads, head_dim)
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None, None, :],
                                                                  scale=scale)
        return output.reshape(batch, q.shape[1], head_dim)
    output, _ = attention(module, q[:, :, None, :], key, value, allowed[:, None, None, :], scaling=scale,
                          is_causal=False)
    return output.reshape(batch, q.shape[1], head_dim)  # [B, 1, H, D]


def is_same_length_fresh_prefill(metadata, *, batch_size: int) -> bool:
    """Every one of the ``batch_size`` sequences brings the same number of new tokens and none has cached ones (a
    training batch): the packed tokens are then a ``[batch, length]`` grid."""
    lengths = metadata.query_lengths
    return (len(lengths) == batch_size and lengths[0] > 0 and len(set(lengths)) == 1
            and list(metadata.kv_lengths) == list(lengths))
