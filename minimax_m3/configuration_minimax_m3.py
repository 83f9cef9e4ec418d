"""MiniMax-M3 text-model configuration (model type ``minimax_m3``).

Accepts both spellings found in the wild and keeps the one it was given when saving:

* the hub checkpoint's: a nested ``sparse_attention_config`` (``sparse_num_index_heads``, ``sparse_index_dim``,
  ``sparse_block_size``, ``sparse_topk_blocks``, ``sparse_local_block``, ``sparse_init_block``,
  ``sparse_attention_freq``, ...) with ``moe_layer_freq``, ``rotary_dim`` / ``partial_rotary_factor`` and
  ``rope_theta``;
* transformers' flat one: ``index_n_heads``, ``index_head_dim``, ``index_block_size``, ``index_topk_blocks``,
  ``index_local_blocks``, ``layer_types``, ``mlp_layer_types`` and ``rope_parameters``.

Loading the official composite config (``model_type: minimax_m3_vl`` with a ``text_config``) yields the text config.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from transformers import PreTrainedConfig

__all__ = ["MiniMaxM3Config", "ROPE_TYPES", "FULL_ATTENTION", "SPARSE_ATTENTION", "DENSE_MLP", "MOE_MLP"]

logger = logging.getLogger(__name__)

FULL_ATTENTION = "full_attention"
SPARSE_ATTENTION = "minimax_m3_sparse"
DENSE_MLP = "dense"
MOE_MLP = "sparse"

_NESTED_TO_FLAT = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}
_FLAT_ONLY_KEYS = ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "index_local_blocks",
                   "layer_types", "mlp_layer_types", "rope_parameters")
_NESTED_ONLY_KEYS = ("sparse_attention_config", "moe_layer_freq")
_INDEX_DTYPES = ("float8_e4m3fn", "bfloat16", "float32")
_ATTENTION_MODES = ("sparse", "dense")
_LEGACY_MOE_IMPLEMENTATIONS = ("sparse", "all_experts")
_PAGE_SELECTIONS = ("indexer", "recent")
_COMPOSITE_TYPES = ("minimax_m3_vl",)
_NATIVE_TYPES = ("minimax_m3_vl_text",)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
"""``rope_parameters["rope_type"]`` values the model serves (transformers' own RoPE initialisation functions compute
all but ``default``); another type raises."""


class MiniMaxM3Config(PreTrainedConfig):
    r"""Configuration of the MiniMax-M3 text model; defaults are the released model's.

    Beyond the checkpoint's fields:
        index_dtype (`str`, defaults to `"float8_e4m3fn"`): dtype of the index path (index q and the paged index-K
            cache): `"float8_e4m3fn"` (saturating cast, no scale, as served), `"bfloat16"` (ablation) or `"float32"`
            (exact parity tests).
        attention_mode (`str`, defaults to `"sparse"`): `"sparse"` runs MiniMax Sparse Attention on the sparse layers;
            `"dense"` runs every layer with full causal attention (the baseline for evaluation).
        sparse_attention_implementation (`str`, defaults to `"auto"`): the sparse attention function by name (see
            `minimax_m3.sparse_attention.SPARSE_ATTENTION_FUNCTIONS`).
        indexer_backend (`str`, defaults to `"auto"`): `backend` of the indexer wrapper.
        max_score_buffer_bytes (`int`, defaults to 8 GiB): bound on the indexer's score buffer (`T * H * pitch`
            fp32, the only allocation that grows faster than the context); longer prompts run in query chunks.
        page_selection (`str`, defaults to `"indexer"`): how sparse layers choose their pages. `"indexer"` is
            MiniMax Sparse Attention; `"recent"` takes the `index_topk_blocks` most recent pages (the local page
            and the pages right before it): the sliding-window baseline of the accuracy evaluation.
        output_router_logits (`bool`, defaults to `False`): return each MoE layer's router logits and add the
            load-balancing loss (`router_aux_loss_coef` times it) to the language-modelling loss.
        router_aux_loss_coef (`float`, defaults to 0.001): weight of that loss.

    The routed experts run through transformers' experts implementations (`experts_implementation=` of
    `from_pretrained` or the config: `"grouped_mm"` by default, `"batched_mm"`, `"eager"`). A saved config's
    `moe_implementation` (`"sparse"` or `"all_experts"`, this package's older switch; both computed the same result)
    is read and dropped: the model runs the experts implementation instead.
    """

    model_type = "minimax_m3"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_experts": "num_local_experts"}

    def __init__(
        self,
        vocab_size: int = 200064,
        hidden_size: int = 6144,
        num_hidden_layers: int = 60,
        num_attention_heads: int = 64,
        num_key_value_heads: int = 4,
        head_dim: int = 128,
        intermediate_size: int = 3072,
        dense_intermediate_size: int = 12288,
        shared_intermediate_size: int = 3072,
        num_local_experts: int = 128,
        num_experts_per_tok: int = 4,
        n_shared_experts: int = 1,
        routed_scaling_factor: float = 2.0,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        swiglu_beta: float = 1.0,
        hidden_act: str = "swigluoai",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 524288,
        rope_theta: Optional[float] = None,
        rotary_dim: Optional[int] = None,
        partial_rotary_factor: Optional[float] = None,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        attention_dropout: float = 0.0,
        sparse_attention_config: Optional[dict] = None,
        moe_layer_freq: Optional[list] = None,
        index_n_heads: Optional[int] = None,
        index_head_dim: Optional[int] = None,
        index_block_size: Optional[int] = None,
        index_topk_blocks: Optional[int] = None,
        index_local_blocks: Optional[int] = None,
        layer_types: Optional[list] = None,
        mlp_layer_types: Optional[list] = None,
        rope_parameters: Optional[dict] = None,
        index_dtype: str = "float8_e4m3fn",
        attention_mode: str = "sparse",
        sparse_attention_implementation: str = "auto",
        indexer_backend: str = "auto",
        max_score_buffer_bytes: int = 8 << 30,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.001,
        page_selection: str = "indexer",
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = 200034,
        eos_token_id: Optional[int] = 200020,
        **kwargs: Any,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.intermediate_size = intermediate_size
        self.dense_intermediate_size = dense_intermediate_size
        self.shared_intermediate_size = shared_intermediate_size
        self.num_local_experts = num_local_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_shared_experts = n_shared_experts
        self.routed_scaling_factor = routed_scaling_factor
        self.swiglu_alpha = swiglu_alpha
        self.swiglu_limit = swiglu_limit
        self.swiglu_beta = swiglu_beta
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.attention_dropout = attention_dropout
        self.index_dtype = index_dtype
        self.attention_mode = attention_mode
        self.sparse_attention_implementation = sparse_attention_implementation
        self.indexer_backend = indexer_backend
        self.max_score_buffer_bytes = max_score_buffer_bytes
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        legacy_moe = kwargs.pop("moe_implementation", None)
        if legacy_moe is not None:
            if legacy_moe not in _LEGACY_MOE_IMPLEMENTATIONS:
                raise ValueError(f"moe_implementation (the older experts switch) must be one of "
                                 f"{_LEGACY_MOE_IMPLEMENTATIONS}, got {legacy_moe!r}; use experts_implementation")
            logger.info("moe_implementation=%r is replaced by transformers' experts_implementation (the same result); "
                        "the model runs %s", legacy_moe, kwargs.get("experts_implementation") or "its default")
        if page_selection not in _PAGE_SELECTIONS:
            raise ValueError(f"page_selection must be one of {_PAGE_SELECTIONS}, got {page_selection!r}")
        self.page_selection = page_selection

        self.spelling = "nested" if sparse_attention_config is not None else "flat"
        sparse = dict(sparse_attention_config or {})
        self.sparse_attention_config = sparse_attention_config
        self.moe_layer_freq = moe_layer_freq

        def pick(flat_value, nested_key, default):
            if flat_value is not None:
                return flat_value
            return sparse.get(nested_key, default)

        self.index_n_heads = pick(index_n_heads, "sparse_num_index_heads", num_key_value_heads)
        self.index_head_dim = pick(index_head_dim, "sparse_index_dim", head_dim)
        self.index_block_size = pick(index_block_size, "sparse_block_size", 128)
        self.index_topk_blocks = pick(index_topk_blocks, "sparse_topk_blocks", 16)
        self.index_local_blocks = pick(index_local_blocks, "sparse_local_block", 1)
        self.index_init_blocks = sparse.get("sparse_init_block", 0)

        if layer_types is None:
            frequency = sparse.get("sparse_attention_freq")
            if frequency is None:
                frequency = [0] * min(3, num_hidden_layers) + [1] * max(0, num_hidden_layers - 3)
            layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in frequency]
        self.layer_types = list(layer_types)
        if mlp_layer_types is None:
            frequency = moe_layer_freq
            if frequency is None:
                frequency = [0] * min(3, num_hidden_layers) + [1] * max(0, num_hidden_layers - 3)
            mlp_layer_types = [MOE_MLP if f else DENSE_MLP for f in frequency]
        self.mlp_layer_types = list(mlp_layer_types)

        if rope_parameters is None and kwargs.get("rope_scaling") is not None:
            rope_parameters = dict(kwargs.pop("rope_scaling"))  # the older name of the same dict
        rope = dict(rope_parameters or {})
        self.rope_parameters = rope_parameters
        self.rope_theta = float(rope_theta if rope_theta is not None else rope.get("rope_theta", 5_000_000.0))
        if rope.get("partial_rotary_factor") is not None:
            # transformers' native model rotates head_dim * factor dimensions: the factor wins over a stale rotary_dim
            partial_rotary_factor = rope["partial_rotary_factor"]
            from_factor = int(round(head_dim * partial_rotary_factor))
            if rotary_dim is not None and rotary_dim != from_factor:
                logger.warning("rope_parameters.partial_rotary_factor = %s gives rotary_dim %d (head_dim %d); the "
                               "config's rotary_dim %d is ignored", partial_rotary_factor, from_factor, head_dim,
                               rotary_dim)
            rotary_dim = from_factor
        if rotary_dim is None and partial_rotary_factor is not None:
            rotary_dim = int(round(head_dim * partial_rotary_factor))
        if rotary_dim is None:
            rotary_dim = head_dim // 2
        self.rotary_dim = rotary_dim
        self.partial_rotary_factor = partial_rotary_factor if partial_rotary_factor is not None else rotary_dim / head_dim

        self.validate_minimax_m3()  # before transformers' own validators, whose messages are less specific
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def validate_minimax_m3(self) -> None:
        """Clear errors for configurations the model cannot run."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.index_n_heads != self.num_key_value_heads:
            raise ValueError(
                f"index_n_heads (sparse_num_index_heads) must equal num_key_value_heads: index head r selects the "
                f"pages of KV head r; got {self.index_n_heads} and {self.num_key_value_heads}"
            )
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.index_head_dim < self.rotary_dim or self.index_head_dim % 2:
            raise ValueError(
                f"index_head_dim must be even and >= rotary_dim ({self.rotary_dim}): the index path uses the same "
                f"partial RoPE; got {self.index_head_dim}"
            )
        for name in ("layer_types", "mlp_layer_types"):
            values = getattr(self, name)
            if len(values) != self.num_hidden_layers:
                raise ValueError(f"{name} must have num_hidden_layers = {self.num_hidden_layers} entries, got {len(values)}")
        if set(self.layer_types) - {FULL_ATTENTION, SPARSE_ATTENTION}:
            raise ValueError(f"layer_types entries must be {FULL_ATTENTION!r} or {SPARSE_ATTENTION!r}, got {self.layer_types}")
        if set(self.mlp_layer_types) - {DENSE_MLP, MOE_MLP}:
            raise ValueError(f"mlp_layer_types entries must be {DENSE_MLP!r} or {MOE_MLP!r}, got {self.mlp_layer_types}")
        if self.index_local_blocks != 1:
            raise ValueError(f"index_local_blocks (sparse_local_block) must be 1 (the forced local page), got {self.index_local_blocks}")
        if self.index_init_blocks:
            raise ValueError(f"sparse_init_block must be 0 (no forced initial pages in MiniMax-M3), got {self.index_init_blocks}")
        if self.index_topk_blocks < 1 or self.index_block_size < 1:
            raise ValueError("index_topk_blocks and index_block_size must be positive")
        if self.index_dtype not in _INDEX_DTYPES:
            raise ValueError(f"index_dtype must be one of {_INDEX_DTYPES}, got {self.index_dtype!r}")
        if self.attention_mode not in _ATTENTION_MODES:
            raise ValueError(f"attention_mode must be one of {_ATTENTION_MODES}, got {self.attention_mode!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters rope_type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError("num_experts_per_tok must not exceed num_local_experts")

    @property
    def rope_type(self) -> str:
        """``rope_parameters["rope_type"]`` (the older key ``type`` too), ``"default"`` without one."""
        parameters = self.rope_parameters or {}
        return parameters.get("rope_type", parameters.get("type", "default"))

    def to_dict(self) -> dict:
        """Serialise with the spelling the config was created with (a re-saved hub config stays loadable by vLLM)."""
        output = super().to_dict()
        output.pop("spelling", None)
        output.pop("index_init_blocks", None)
        dropped = _FLAT_ONLY_KEYS if self.spelling == "nested" else _NESTED_ONLY_KEYS
        for key in dropped:
            output.pop(key, None)
        if self.spelling == "nested" and self.rope_type != "default":
            # the hub spelling names a RoPE scaling `rope_scaling` (theta and the rotated share are top-level keys)
            output["rope_scaling"] = {key: value for key, value in self.rope_parameters.items()
                                      if key not in ("rope_theta", "partial_rotary_factor")}
        return output

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """transformers' reading, with the official composite config folded into its text config (see
        ``text_config_dict``) before transformers would pick the bare ``text_config`` and drop the rest."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        config_dict = text_config_dict(config_dict)
        if config_dict.get("model_type") in _NATIVE_TYPES:  # a layout this config reads (transformers would warn)
            config_dict["model_type"] = cls.model_type
        return config_dict, kwargs

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Also accepts the official composite config (``minimax_m3_vl`` with a ``text_config``)."""
        config_dict = text_config_dict(config_dict)
        config_dict.pop("model_type", None)
        return super().from_dict(config_dict, **kwargs)


def text_config_dict(config_dict: dict) -> dict:
    """The text model's config from any of the layouts: the official composite's ``text_config`` with the top-level
    ``tie_word_embeddings``, ``dtype`` and ``quantization_config`` it lacks, or a flat config as it is.

    An MXFP8 ``quantization_config`` gets ``dequantize: True`` unless it says otherwise: transformers' FineGrainedFP8
    quantizer then dequantises the weights to the requested dtype at load, which is what this model runs."""
    if config_dict.get("model_type") in _COMPOSITE_TYPES or "text_config" in config_dict:
        text = dict(config_dict.get("text_config") or {})
        text.pop("model_type", None)
        for key in ("tie_word_embeddings", "dtype", "torch_dtype", "quantization_config"):
            if key in config_dict and key not in text:
                text[key] = config_dict[key]
        config_dict = text
    else:
        config_dict = dict(config_dict)
    quantization = config_dict.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp8":
        config_dict["quantization_config"] = {"dequantize": True, **quantization}
    return config_dict
