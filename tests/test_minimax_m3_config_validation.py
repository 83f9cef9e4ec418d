"""MiniMaxM3Config refuses, naming the field, every value the model would compute garbage with or crash on later,
and two spellings of one field that disagree; the configs the release and the tests use still construct."""

import json
import math
import re
from pathlib import Path

import pytest

import minimax_m3  # noqa: F401  (registers the Auto classes)
from minimax_m3 import MiniMaxM3Config
from minimax_m3.configuration_minimax_m3 import FULL_ATTENTION, SPARSE_ATTENTION
from test_minimax_m3 import SPARSE_CONFIG, tiny_config

NESTED = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
          "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
          "index_local_blocks": "sparse_local_block"}
POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "dense_intermediate_size", "shared_intermediate_size",
                 "num_local_experts", "num_experts_per_tok", "max_position_embeddings", "index_n_heads",
                 "index_head_dim", "index_block_size", "index_topk_blocks", "max_score_buffer_bytes")


def flat_config(**overrides) -> MiniMaxM3Config:
    """tiny_config's model in transformers' flat spelling."""
    values = dict(
        vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=48, dense_intermediate_size=96, shared_intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, rotary_dim=16, index_n_heads=2, index_head_dim=32, index_block_size=8,
        index_topk_blocks=3, index_local_blocks=1, layer_types=[FULL_ATTENTION, SPARSE_ATTENTION, SPARSE_ATTENTION],
        mlp_layer_types=["dense", "sparse", "sparse"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
        index_dtype="float32",
    )
    values.update(overrides)
    return MiniMaxM3Config(**values)


def nested_override(field, value) -> dict:
    """``field = value`` in the spelling tiny_config uses for it."""
    if field in NESTED:
        return dict(sparse_attention_config={**SPARSE_CONFIG, NESTED[field]: value})
    return {field: value}


def label(field) -> str:
    return f"{field} ({NESTED[field]})" if field in NESTED else field


def raises_naming(text, build):
    with pytest.raises(ValueError, match=re.escape(text)):
        build()


def reloaded(config, tmp_path) -> MiniMaxM3Config:
    config.save_pretrained(tmp_path)
    return MiniMaxM3Config.from_pretrained(tmp_path)


# ------------------------------------------------------------------ the configs in use still construct
def test_the_release_default_config_constructs_and_round_trips(tmp_path):
    release = MiniMaxM3Config()
    assert (release.rotary_dim, release.rope_theta, release.hidden_act) == (64, 5e6, "swigluoai")
    again = reloaded(release, tmp_path)
    assert again.layer_types == release.layer_types and again.rotary_dim == 64


def test_the_tiny_configs_of_the_tests_and_evals_construct():
    from eval.default_model import tiny_config as default_model_config
    from eval.throughput import single_sparse_layer_config
    from eval.train_tiny import tiny_model_config
    from minimax_m3.bench_prefill import geometry_config
    from minimax_m3.synthetic_checkpoint import released_slice_config
    from test_synthetic_checkpoint import TINY

    tiny_config(), flat_config(), default_model_config(), tiny_model_config(512), released_slice_config()
    released_slice_config(1, 2, **TINY)
    for tiny in (True, False):
        single_sparse_layer_config(geometry_config(2, tiny=tiny))
        geometry_config(1, tiny=tiny, dense_layers=0)
        geometry_config(2, tiny=tiny, real_moe=True)
    embedded = Path(__file__).resolve().parents[1] / "eval" / "models" / "tiny-minimax-m3-retrieval"
    MiniMaxM3Config.from_pretrained(embedded)


# ------------------------------------------------------------------ positivity and ranges
@pytest.mark.parametrize("value", [0, -2, True, 2.5, "8"], ids=repr)
@pytest.mark.parametrize("field", POSITIVE_INTS)
def test_sizes_and_counts_must_be_ints_of_at_least_one(field, value):
    """Checked before any arithmetic: zero heads raised ZeroDivisionError, a zero head_dim divided by zero."""
    raises_naming(f"{label(field)} must be an int >= 1, got {value!r}", lambda: tiny_config(**nested_override(field, value)))


@pytest.mark.parametrize("field", sorted(NESTED.keys() - {"index_local_blocks"}))
def test_the_flat_spelling_of_the_index_sizes_is_checked_too(field):
    raises_naming(f"{label(field)} must be an int >= 1, got 0", lambda: flat_config(**{field: 0}))


@pytest.mark.parametrize("value", [True, 1.0], ids=repr)
def test_the_local_page_count_must_be_the_int_one(value):
    raises_naming("index_local_blocks (sparse_local_block) must be 1",
                  lambda: tiny_config(**nested_override("index_local_blocks", value)))


@pytest.mark.parametrize("field, value", [
    ("rope_theta", 0), ("rope_theta", -1e4), ("rope_theta", math.nan), ("rope_theta", math.inf), ("rope_theta", True),
    ("rope_theta", "1e4"),
    ("rms_norm_eps", 0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", math.nan),
    ("routed_scaling_factor", 0), ("routed_scaling_factor", -2.0), ("routed_scaling_factor", math.inf),
    ("routed_scaling_factor", math.nan),
], ids=str)
def test_scales_must_be_finite_positive_numbers(field, value):
    raises_naming(f"{field} must be a finite number > 0, got {value!r}", lambda: tiny_config(**{field: value}))


def test_the_rope_theta_of_rope_parameters_is_checked_too():
    raises_naming("rope_theta must be a finite number > 0, got 0",
                  lambda: tiny_config(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 0}))


@pytest.mark.parametrize("field, value, expected", [
    ("swiglu_limit", 0, "a number > 0"), ("swiglu_limit", -7.0, "a number > 0"), ("swiglu_limit", math.nan, "a number > 0"),
    ("swiglu_alpha", math.nan, "a finite number"), ("swiglu_alpha", math.inf, "a finite number"),
    ("swiglu_alpha", "1.702", "a finite number"), ("swiglu_beta", -math.inf, "a finite number"),
    ("swiglu_beta", math.nan, "a finite number"),
    ("attention_dropout", -0.1, "a number in [0, 1)"), ("attention_dropout", 1.0, "a number in [0, 1)"),
    ("attention_dropout", math.nan, "a number in [0, 1)"),
    ("n_shared_experts", -1, "an int >= 0"), ("n_shared_experts", True, "an int >= 0"),
], ids=str)
def test_activation_dropout_and_shared_expert_values_are_checked(field, value, expected):
    raises_naming(f"{field} must be {expected}, got {value!r}", lambda: tiny_config(**{field: value}))


def test_an_unclamped_swiglu_and_no_shared_expert_are_accepted():
    config = tiny_config(swiglu_limit=math.inf, n_shared_experts=0, attention_dropout=0.5)
    assert config.swiglu_limit == math.inf


@pytest.mark.parametrize("overrides, text", [
    (dict(rotary_dim="16", partial_rotary_factor=None), "rotary_dim must be an int, got '16'"),
    (dict(rotary_dim=True, partial_rotary_factor=None), "rotary_dim must be an int, got True"),
    (dict(rotary_dim=None, partial_rotary_factor=0), "partial_rotary_factor must be a number in (0, 1], got 0"),
    (dict(rotary_dim=None, partial_rotary_factor=1.5), "partial_rotary_factor must be a number in (0, 1], got 1.5"),
    (dict(rotary_dim=None, partial_rotary_factor=math.nan), "partial_rotary_factor must be a number in (0, 1]"),
    (dict(rotary_dim=None, partial_rotary_factor=0.3), "partial_rotary_factor = 0.3 rotates head_dim 32 * 0.3 = 9.6"),
    (dict(rotary_dim=None, partial_rotary_factor=None, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.3}),
     "rope_parameters partial_rotary_factor = 0.3 rotates head_dim 32 * 0.3 = 9.6"),
], ids=str)
def test_the_rotated_share_must_be_a_whole_number_of_dimensions(overrides, text):
    raises_naming(text, lambda: tiny_config(**overrides))


@pytest.mark.parametrize("value", ["gelu", "relu", None])
def test_an_unknown_activation_raises(value):
    raises_naming(f"hidden_act must be 'swigluoai' (or 'silu', transformers' name for it) or 'silu_and_mul' (a plain "
                  f"SiLU-gated MLP), got {value!r}",
                  lambda: tiny_config(hidden_act=value))


def test_silu_is_transformers_name_for_the_swiglu_oai_activation(tmp_path):
    from minimax_m3 import MiniMaxM3ForCausalLM
    import torch

    config = tiny_config(hidden_act="silu")
    assert reloaded(config, tmp_path).hidden_act == "silu"
    ids = torch.randint(3, 97, (1, 20))
    torch.manual_seed(0)
    silu = MiniMaxM3ForCausalLM(config).eval()
    torch.manual_seed(0)
    swigluoai = MiniMaxM3ForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        assert torch.equal(silu(ids).logits, swigluoai(ids).logits)


@pytest.mark.parametrize("overrides, text", [
    (dict(sparse_attention_config="sparse"), "sparse_attention_config must be a dict"),
    (dict(rope_parameters=[("rope_type", "default")]), "rope_parameters must be a dict"),
    (dict(rope_scaling="yarn"), "rope_scaling must be a dict"),
    (dict(moe_layer_freq=None, mlp_layer_types="sparse"), "mlp_layer_types must be a list"),
    (dict(sparse_attention_config={**SPARSE_CONFIG, "use_sparse_attention": "no"}),
     "use_sparse_attention must be true or false, got 'no'"),
], ids=str)
def test_containers_of_the_wrong_kind_raise(overrides, text):
    raises_naming(text, lambda: tiny_config(**overrides))


def test_values_set_after_construction_are_checked_by_validate_and_from_pretrained(tmp_path):
    """eval switches modes by setting attributes, then validates; from_pretrained sets its keyword overrides after
    __init__."""
    config = tiny_config()
    config.rope_theta = 0.0
    raises_naming("rope_theta must be a finite number > 0", config.validate_minimax_m3)
    tiny_config().save_pretrained(tmp_path)
    raises_naming("index_topk_blocks (sparse_topk_blocks) must be an int >= 1, got 0",
                  lambda: MiniMaxM3Config.from_pretrained(tmp_path, index_topk_blocks=0))
    assert MiniMaxM3Config.from_pretrained(tmp_path, index_topk_blocks=5).index_topk_blocks == 5


# ------------------------------------------------------------------ two spellings of one field
@pytest.mark.parametrize("field, flat, nested", [
    ("index_n_heads", 1, 2), ("index_head_dim", 16, 32), ("index_block_size", 16, 8), ("index_topk_blocks", 5, 3),
    ("index_local_blocks", 2, 1),
])
def test_disagreeing_flat_and_nested_index_fields_raise(field, flat, nested):
    """The flat value won in memory, the nested one was saved: a top-k of 5 reloaded as 3."""
    raises_naming(f"{field} = {flat} and sparse_attention_config {NESTED[field]} = {nested} disagree",
                  lambda: tiny_config(**{field: flat}))


def test_agreeing_spellings_are_accepted_and_a_flat_only_value_survives_the_hub_spelling(tmp_path):
    assert tiny_config(index_topk_blocks=3, index_block_size=8).index_topk_blocks == 3
    partial = {key: value for key, value in SPARSE_CONFIG.items() if key != "sparse_topk_blocks"}
    config = tiny_config(sparse_attention_config=partial, index_topk_blocks=5)
    assert reloaded(config, tmp_path / "given").index_topk_blocks == 5
    config = tiny_config()
    config.index_topk_blocks, config.mlp_layer_types = 5, ["dense", "dense", "sparse"]
    again = reloaded(config, tmp_path / "set")
    assert again.index_topk_blocks == 5 and again.mlp_layer_types == ["dense", "dense", "sparse"]


def test_layer_types_disagreeing_with_sparse_attention_freq_raise():
    raises_naming("layer_types ['full_attention', 'full_attention', 'minimax_m3_sparse'] and sparse_attention_config "
                  "sparse_attention_freq [0, 1, 1] disagree",
                  lambda: tiny_config(layer_types=[FULL_ATTENTION, FULL_ATTENTION, SPARSE_ATTENTION]))
    same = [FULL_ATTENTION, SPARSE_ATTENTION, SPARSE_ATTENTION]
    assert tiny_config(layer_types=same).layer_types == same


def test_mlp_layer_types_disagreeing_with_moe_layer_freq_raise():
    raises_naming("mlp_layer_types ['dense', 'dense', 'sparse'] and moe_layer_freq [0, 1, 1] disagree",
                  lambda: tiny_config(mlp_layer_types=["dense", "dense", "sparse"]))
    assert tiny_config(mlp_layer_types=["dense", "sparse", "sparse"]).mlp_layer_types == ["dense", "sparse", "sparse"]


def test_rotary_dim_disagreeing_with_partial_rotary_factor_raises():
    raises_naming("rotary_dim = 8 and partial_rotary_factor = 0.5 (head_dim 32) disagree",
                  lambda: tiny_config(rotary_dim=8))
    assert tiny_config(rotary_dim=8, partial_rotary_factor=0.25).rotary_dim == 8


def test_rope_parameters_disagreeing_with_the_top_level_rope_keys_raise():
    raises_naming("rope_theta = 5000000.0 and rope_parameters rope_theta = 10000.0 disagree",
                  lambda: tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    raises_naming("partial_rotary_factor = 0.25 and rope_parameters partial_rotary_factor = 0.5 disagree",
                  lambda: tiny_config(rotary_dim=None, partial_rotary_factor=0.25,
                                      rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}))
    raises_naming("rope_parameters {'rope_type': 'linear', 'factor': 2.0} and rope_scaling {'rope_type': 'linear', "
                  "'factor': 4.0} disagree",
                  lambda: tiny_config(rope_parameters={"rope_type": "linear", "factor": 2.0},
                                      rope_scaling={"rope_type": "linear", "factor": 4.0}))
    agreeing = tiny_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e6},
                           rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert agreeing.rope_type == "linear"


def test_the_given_rope_parameters_dict_is_not_changed():
    rope = {"rope_type": "linear", "factor": 2.0}
    tiny_config(rope_parameters=rope)
    assert rope == {"rope_type": "linear", "factor": 2.0}


# ------------------------------------------------------------------ use_sparse_attention
def test_use_sparse_attention_false_makes_every_layer_full_attention_and_reloads_so(tmp_path):
    """Five layers: without the flag the default pattern would make the last two sparse."""
    off = {key: value for key, value in SPARSE_CONFIG.items() if key != "sparse_attention_freq"}
    five = dict(num_hidden_layers=5, moe_layer_freq=[0, 1, 1, 1, 1])
    assert tiny_config(sparse_attention_config=off, **five).layer_types[3:] == [SPARSE_ATTENTION] * 2
    config = tiny_config(sparse_attention_config={**off, "use_sparse_attention": False}, **five)
    assert config.layer_types == [FULL_ATTENTION] * 5
    again = reloaded(config, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["sparse_attention_config"]
    assert saved["use_sparse_attention"] is False and again.layer_types == [FULL_ATTENTION] * 5
    explicit = tiny_config(sparse_attention_config={**SPARSE_CONFIG, "use_sparse_attention": False,
                                                    "sparse_attention_freq": [0, 0, 0]})
    assert explicit.layer_types == [FULL_ATTENTION] * 3


@pytest.mark.parametrize("overrides", [
    dict(sparse_attention_config={**SPARSE_CONFIG, "use_sparse_attention": False}),
    dict(sparse_attention_config={key: value for key, value in {**SPARSE_CONFIG, "use_sparse_attention": False}.items()
                                  if key != "sparse_attention_freq"},
         layer_types=[FULL_ATTENTION, SPARSE_ATTENTION, SPARSE_ATTENTION]),
], ids=["sparse_attention_freq", "layer_types"])
def test_use_sparse_attention_false_with_sparse_layers_raises(overrides):
    raises_naming("sparse_attention_config use_sparse_attention is false but the layer pattern",
                  lambda: tiny_config(**overrides))
