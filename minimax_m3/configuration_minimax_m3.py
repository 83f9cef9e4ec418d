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
import math
import numbers
from typing import Any, Optional

from transformers import PreTrainedConfig

__all__ = ["MiniMaxM3Config", "ROPE_TYPES", "SILU_AND_MUL", "SWIGLU_OAI_ACTS", "FULL_ATTENTION", "SPARSE_ATTENTION",
           "DENSE_MLP", "MOE_MLP"]

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
_FLAT_TO_NESTED = {flat: nested for nested, flat in _NESTED_TO_FLAT.items()}
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "dense_intermediate_size", "shared_intermediate_size",
                  "num_local_experts", "num_experts_per_tok", "max_position_embeddings", "index_n_heads",
                  "index_head_dim", "index_block_size", "index_topk_blocks", "max_score_buffer_bytes")
_POSITIVE_NUMBERS = ("rms_norm_eps", "routed_scaling_factor")
SWIGLU_OAI_ACTS = ("swigluoai", "silu")
"""``hidden_act`` values meaning SwiGLU-OAI: ``"silu"`` is what transformers' native MiniMax-M3 config writes for it."""
SILU_AND_MUL = "silu_and_mul"
"""``hidden_act`` of a plain SiLU-gated MLP, ``silu(gate) * up`` (Llama's; vLLM's ``SiluAndMul``): for models
converted to this architecture. Not ``"silu"``, which transformers' native config uses for SwiGLU-OAI."""
_HIDDEN_ACTS = SWIGLU_OAI_ACTS + (SILU_AND_MUL,)
_NATIVE_TYPES = ("minimax_m3_vl_text",)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
"""``rope_parameters["rope_type"]`` values the model serves (transformers' own RoPE initialisation functions compute
all but ``default``); another type raises."""


class MiniMaxM3Config(PreTrainedConfig):
    r"""Configuration of the MiniMax-M3 text model; defaults are the released model's.

    Every field is validated at construction (and by ``validate_minimax_m3``): a value the model cannot compute with,
    or two spellings of one field that disagree, raises a ``ValueError`` naming the field.

    Of the checkpoint's fields:
        hidden_act (`str`, defaults to `"swigluoai"`): the gated activation of every MLP and expert. `"swigluoai"`
            is the release's SwiGLU-OAI (`swiglu_alpha`, `swiglu_limit`, `swiglu_beta`); `"silu"`, which transformers'
            native config writes for it, means the same. `"silu_and_mul"` is a plain `silu(gate) * up` (Llama's MLP),
            for dense models converted to this architecture.
        use_gemma_norm (`bool`, defaults to `True`): every RMSNorm is Gemma's `x_hat * (1 + w)` (weights stored as the
            offset `w`, zeros at init); `False` gives the standard `x_hat * w` (ones at init).
        use_qk_norm (`bool`, defaults to `True`): attention's per-head RMSNorm of q and k before RoPE (`q_norm`,
            `k_norm`); `False` rotates the projections as they are and the layers have no such weights. The index
            path always has its norms (`index_q_norm`, `index_k_norm`).
        partial_rotary_factor / rotary_dim: the rotated share of each head (the release: half); `1` rotates all.
        tie_word_embeddings (`bool`, defaults to `False`): `lm_head` shares `embed_tokens`' weight.
        sparse_attention_config (`dict`): the hub spelling; its `use_sparse_attention = false` makes every layer
            full attention (a layer pattern that still marks sparse layers raises).

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
    # transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under torchrun): the attention
    # projections split by whole heads, so a rank holds whole KV groups and the index heads of those groups (index
    # head r selects for KV group r); index_k_proj, one key head shared by all index heads, and the norms and router
    # are replicated; o_proj and the MLPs' down projections reduce across ranks
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.index_q_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.block_sparse_moe.shared_experts.gate_proj": "colwise",
        "layers.*.block_sparse_moe.shared_experts.up_proj": "colwise",
        "layers.*.block_sparse_moe.shared_experts.down_proj": "rowwise",
        "layers.*.block_sparse_moe.experts.gate_up_proj": "packed_colwise",
        "layers.*.block_sparse_moe.experts.down_proj": "rowwise",
        "layers.*.block_sparse_moe.experts": "moe_tp_experts",
    }
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
        use_gemma_norm: bool = True,
        use_qk_norm: bool = True,
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
        self.use_gemma_norm = use_gemma_norm
        self.use_qk_norm = use_qk_norm
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

        if sparse_attention_config is not None and not isinstance(sparse_attention_config, dict):
            raise ValueError(f"sparse_attention_config must be a dict, got {sparse_attention_config!r}")
        self.spelling = "nested" if sparse_attention_config is not None else "flat"
        sparse = dict(sparse_attention_config or {})
        self.sparse_attention_config = dict(sparse) if sparse_attention_config is not None else None
        self.moe_layer_freq = moe_layer_freq

        def pick(flat_name, flat_value, default):
            # both spellings given: the flat one would win in memory while to_dict writes the nested one
            nested_key = _FLAT_TO_NESTED.get(flat_name, flat_name)
            if flat_value is not None and nested_key in sparse and sparse[nested_key] != flat_value:
                raise ValueError(f"{flat_name} = {flat_value!r} and sparse_attention_config {nested_key} = "
                                 f"{sparse[nested_key]!r} disagree: give one spelling or equal values")
            return flat_value if flat_value is not None else sparse.get(nested_key, default)

        self.index_n_heads = pick("index_n_heads", index_n_heads, num_key_value_heads)
        self.index_head_dim = pick("index_head_dim", index_head_dim, head_dim)
        self.index_block_size = pick("index_block_size", index_block_size, 128)
        self.index_topk_blocks = pick("index_topk_blocks", index_topk_blocks, 16)
        self.index_local_blocks = pick("index_local_blocks", index_local_blocks, 1)
        self.index_init_blocks = sparse.get("sparse_init_block", 0)
        self._validate_scalars()  # the layer lists and the rotary share below do arithmetic on these

        use_sparse = sparse.get("use_sparse_attention")
        if use_sparse is not None and not isinstance(use_sparse, bool):
            raise ValueError(f"sparse_attention_config use_sparse_attention must be true or false, got {use_sparse!r}")
        frequency = sparse.get("sparse_attention_freq")
        layer_types = _layer_kinds("layer_types", layer_types, "sparse_attention_config sparse_attention_freq",
                                   frequency, SPARSE_ATTENTION, FULL_ATTENTION)
        if layer_types is None:
            if frequency is None:
                frequency = ([0] * num_hidden_layers if use_sparse is False else
                             [0] * min(3, num_hidden_layers) + [1] * max(0, num_hidden_layers - 3))
            layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in frequency]
        self.layer_types = list(layer_types)
        if use_sparse is False and SPARSE_ATTENTION in self.layer_types:
            raise ValueError(f"sparse_attention_config use_sparse_attention is false but the layer pattern "
                             f"(layer_types or sparse_attention_freq) has sparse layers: {self.layer_types}")
        mlp_layer_types = _layer_kinds("mlp_layer_types", mlp_layer_types, "moe_layer_freq", moe_layer_freq,
                                       MOE_MLP, DENSE_MLP)
        if mlp_layer_types is None:
            frequency = moe_layer_freq
            if frequency is None:
                frequency = [0] * min(3, num_hidden_layers) + [1] * max(0, num_hidden_layers - 3)
            mlp_layer_types = [MOE_MLP if f else DENSE_MLP for f in frequency]
        self.mlp_layer_types = list(mlp_layer_types)

        rope_scaling = kwargs.pop("rope_scaling", None)  # the older name of rope_parameters (the hub spelling's)
        for name, value in (("rope_parameters", rope_parameters), ("rope_scaling", rope_scaling)):
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{name} must be a dict, got {value!r}")
        if rope_parameters is None:
            rope_parameters = rope_scaling
        elif rope_scaling is not None and _scaling_of(rope_scaling) != _scaling_of(rope_parameters):
            # transformers' base config would take rope_scaling over rope_parameters after validation
            raise ValueError(f"rope_parameters {rope_parameters} and rope_scaling {rope_scaling} disagree: give one "
                             f"spelling or equal values")
        rope = dict(rope_parameters or {})
        self.rope_parameters = rope if rope_parameters is not None else None  # a copy: transformers fills it in
        theta = rope.get("rope_theta")
        if rope_theta is not None and theta is not None and rope_theta != theta:
            raise ValueError(f"rope_theta = {rope_theta!r} and rope_parameters rope_theta = {theta!r} disagree: give "
                             f"one spelling or equal values")
        self.rope_theta = rope_theta if rope_theta is not None else (theta if theta is not None else 5_000_000.0)
        _check_number("rope_theta", self.rope_theta)
        self.rope_theta = float(self.rope_theta)
        if rotary_dim is not None and not _is_int(rotary_dim):
            raise ValueError(f"rotary_dim must be an int, got {rotary_dim!r}")
        if rotary_dim is not None and partial_rotary_factor is not None:
            if _rotary_dim_of(head_dim, partial_rotary_factor, "partial_rotary_factor") != rotary_dim:
                raise ValueError(f"rotary_dim = {rotary_dim} and partial_rotary_factor = {partial_rotary_factor} "
                                 f"(head_dim {head_dim}) disagree: give one or consistent values")
        if rope.get("partial_rotary_factor") is not None:
            # transformers' native model rotates head_dim * factor dimensions: the factor wins over a stale rotary_dim
            factor = rope["partial_rotary_factor"]
            from_factor = _rotary_dim_of(head_dim, factor, "rope_parameters partial_rotary_factor")
            if partial_rotary_factor is not None and partial_rotary_factor != factor:
                raise ValueError(f"partial_rotary_factor = {partial_rotary_factor!r} and rope_parameters "
                                 f"partial_rotary_factor = {factor!r} disagree: give one spelling or equal values")
            if rotary_dim is not None and rotary_dim != from_factor:
                logger.warning("rope_parameters.partial_rotary_factor = %s gives rotary_dim %d (head_dim %d); the "
                               "config's rotary_dim %d is ignored", factor, from_factor, head_dim, rotary_dim)
            partial_rotary_factor, rotary_dim = factor, from_factor
        if rotary_dim is None and partial_rotary_factor is not None:
            rotary_dim = _rotary_dim_of(head_dim, partial_rotary_factor, "partial_rotary_factor")
        if rotary_dim is None:
            rotary_dim = head_dim // 2
        self.rotary_dim = rotary_dim
        self.partial_rotary_factor = partial_rotary_factor if partial_rotary_factor is not None else rotary_dim / head_dim

        self.validate_minimax_m3()  # before transformers' own validators, whose messages are less specific
        if not isinstance(tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be true or false, got {tie_word_embeddings!r}")
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def _validate_scalars(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{_label(name)} must be an int >= 1, got {value!r}")
        if not _is_int(self.n_shared_experts) or self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be an int >= 0, got {self.n_shared_experts!r}")
        for name in _POSITIVE_NUMBERS:
            _check_number(name, getattr(self, name))
        if not _is_number(self.swiglu_limit) or not self.swiglu_limit > 0:  # inf is a gate without a clamp
            raise ValueError(f"swiglu_limit must be a number > 0, got {self.swiglu_limit!r}")
        for name in ("swiglu_alpha", "swiglu_beta"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not _is_number(self.attention_dropout) or not 0 <= self.attention_dropout < 1:
            raise ValueError(f"attention_dropout must be a number in [0, 1), got {self.attention_dropout!r}")
        if self.hidden_act not in _HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be 'swigluoai' (or 'silu', transformers' name for it) or "
                             f"'silu_and_mul' (a plain SiLU-gated MLP), got {self.hidden_act!r}")
        for name in ("use_gemma_norm", "use_qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def validate_minimax_m3(self) -> None:
        """Clear errors for configurations the model cannot run."""
        self._validate_scalars()
        _check_number("rope_theta", self.rope_theta)
        if not _is_int(self.rotary_dim):
            raise ValueError(f"rotary_dim must be an int, got {self.rotary_dim!r}")
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
        if not _is_int(self.index_local_blocks) or self.index_local_blocks != 1:
            raise ValueError(f"index_local_blocks (sparse_local_block) must be 1 (the forced local page), got {self.index_local_blocks}")
        if self.index_init_blocks:
            raise ValueError(f"sparse_init_block must be 0 (no forced initial pages in MiniMax-M3), got {self.index_init_blocks}")
        if self.index_dtype not in _INDEX_DTYPES:
            raise ValueError(f"index_dtype must be one of {_INDEX_DTYPES}, got {self.index_dtype!r}")
        if self.attention_mode not in _ATTENTION_MODES:
            raise ValueError(f"attention_mode must be one of {_ATTENTION_MODES}, got {self.attention_mode!r}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters rope_type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must not exceed num_local_experts "
                             f"({self.num_local_experts})")

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
        if self.spelling == "nested":
            # the values in memory (given flat, or set after construction) are the ones that must reload
            sparse = dict(self.sparse_attention_config or {})
            sparse.update({nested: getattr(self, flat) for nested, flat in _NESTED_TO_FLAT.items()})
            sparse["sparse_attention_freq"] = [int(kind == SPARSE_ATTENTION) for kind in self.layer_types]
            output["sparse_attention_config"] = sparse
            output["moe_layer_freq"] = [int(kind == MOE_MLP) for kind in self.mlp_layer_types]
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
        loaded = super().from_dict(config_dict, **kwargs)
        # transformers sets from_pretrained's keyword overrides after __init__, past its validation
        (loaded[0] if isinstance(loaded, tuple) else loaded).validate_minimax_m3()
        return loaded


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # True is an int in Python


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_number(name: str, value) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _label(name: str) -> str:
    """A field's name with its hub spelling's, where it has one."""
    return f"{name} ({_FLAT_TO_NESTED[name]})" if name in _FLAT_TO_NESTED else name


def _layer_kinds(name: str, kinds, frequency_name: str, frequency, marked: str, unmarked: str):
    """``kinds`` as a list (None when not given); raises if the 0/1 ``frequency`` spelling says otherwise."""
    if kinds is None:
        return None
    if not isinstance(kinds, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {kinds!r}")
    if frequency is not None and list(kinds) != [marked if f else unmarked for f in frequency]:
        raise ValueError(f"{name} {list(kinds)} and {frequency_name} {list(frequency)} disagree: give one spelling or "
                         f"equal values")
    return list(kinds)


def _scaling_of(rope: dict) -> dict:
    # the hub spelling's rope_scaling carries neither theta nor the rotated share (top-level keys there)
    return {key: value for key, value in rope.items() if key not in ("rope_theta", "partial_rotary_factor")}


def _rotary_dim_of(head_dim: int, factor, name: str) -> int:
    """``head_dim * factor``, which must be a whole number: the native model and this one would otherwise round it
    differently."""
    if not _is_number(factor) or not 0 < factor <= 1:
        raise ValueError(f"{name} must be a number in (0, 1], got {factor!r}")
    rotated = head_dim * factor
    if not math.isclose(rotated, round(rotated), abs_tol=1e-6):
        raise ValueError(f"{name} = {factor!r} rotates head_dim {head_dim} * {factor!r} = {rotated:g} dimensions, "
                         f"not a whole number")
    return int(round(rotated))


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
