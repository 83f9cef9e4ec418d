"""The config options a dense Llama model needs in the M3 architecture, each against its formula, and the conversion
of a random Llama built on the fly: dense logits equal Llama's in fp32."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import minimax_m3  # noqa: F401  (registers the Auto classes)
from minimax_m3 import MiniMaxM3ForCausalLM
from minimax_m3.from_llama import INDEXER_SUFFIXES, convert_llama, minimax_m3_config_from_llama
from minimax_m3.modeling_minimax_m3 import MiniMaxM3MLP, MiniMaxM3RMSNorm
from test_minimax_m3 import tiny_config

LLAMA = dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 1e5}, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONVERSION = dict(first_sparse_layer=1, index_block_size=4, index_topk_blocks=3)


def random_llama(seed=0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)  # trained norms sit around 1, and no two are equal
            else:
                parameter.normal_(std=0.2)
    return model


def rotate_by_complex_numbers(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, as complex multiplication: dimension i pairs with i + D/2."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    rotation = torch.polar(torch.ones(len(positions), half, dtype=torch.float64), positions[:, None].double() * frequencies)
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double()) * rotation[:, None, :]
    return torch.cat([pairs.real, pairs.imag], dim=-1).to(x.dtype)


# ------------------------------------------------------------------ the options, against formulas
def test_the_standard_rms_norm_is_x_hat_times_w_and_gemma_is_x_hat_times_one_plus_w():
    x = torch.randn(5, 7, 16, dtype=torch.float64).float()
    weight = torch.rand(16) + 0.5
    reference = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    standard, gemma = MiniMaxM3RMSNorm(16, 1e-5, gemma=False), MiniMaxM3RMSNorm(16, 1e-5)
    assert torch.equal(standard.weight, torch.ones(16)) and torch.equal(gemma.weight, torch.zeros(16))  # identity
    with torch.no_grad():
        standard.weight.copy_(weight)
        gemma.weight.copy_(weight)
    torch.testing.assert_close(standard(x).double(), reference * weight.double(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gemma(x).double(), reference * (1 + weight.double()), atol=1e-6, rtol=1e-6)


def test_a_model_without_gemma_norms_initialises_every_norm_to_ones():
    model = MiniMaxM3ForCausalLM(tiny_config(use_gemma_norm=False))
    norms = {name: p for name, p in model.named_parameters() if "norm" in name}
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms.values())
    gemma = MiniMaxM3ForCausalLM(tiny_config())
    assert all(torch.equal(p, torch.zeros_like(p)) for name, p in gemma.named_parameters() if "norm" in name)


def test_silu_and_mul_is_the_plain_silu_gated_mlp():
    config = tiny_config(hidden_act="silu_and_mul")
    mlp = MiniMaxM3MLP(config, 40)
    x = torch.randn(9, config.hidden_size) * 3  # beyond SwiGLU-OAI's clamp of 7, where the two differ
    gate, up = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    expected = (gate / (1 + torch.exp(-gate)) * up) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)
    swiglu_oai = MiniMaxM3MLP(tiny_config(), 40)
    swiglu_oai.load_state_dict(mlp.state_dict())
    assert not torch.allclose(swiglu_oai(x), expected, atol=1e-2)


def test_without_qk_norm_attention_rotates_the_projections_over_the_whole_head():
    config = tiny_config(use_qk_norm=False, rotary_dim=None, partial_rotary_factor=1.0, rope_theta=1e4)
    assert config.rotary_dim == config.head_dim == 32
    model = MiniMaxM3ForCausalLM(config).eval()
    attention = model.model.layers[1].self_attn
    names = [name for name, _ in model.named_parameters()]
    assert not any(".q_norm." in name or ".k_norm." in name for name in names)
    assert any(".index_q_norm." in name for name in names)  # the index path keeps its norms
    positions = torch.tensor([0, 1, 5, 17, 300])
    x = torch.randn(5, config.hidden_size)
    cos, sin = model.model.rotary_emb(positions)
    q, k, v = attention.query_key_value(x, cos, sin)
    expected_q = rotate_by_complex_numbers((x @ attention.q_proj.weight.T).view(5, 4, 32), positions, 1e4)
    expected_k = rotate_by_complex_numbers((x @ attention.k_proj.weight.T).view(5, 2, 32), positions, 1e4)
    torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(k, expected_k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v, (x @ attention.v_proj.weight.T).view(5, 2, 32))


def test_tied_embeddings_share_one_tensor_and_reload_tied(tmp_path):
    model = MiniMaxM3ForCausalLM(tiny_config(tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    reloaded = MiniMaxM3ForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert not MiniMaxM3ForCausalLM(tiny_config()).lm_head.weight is MiniMaxM3ForCausalLM(tiny_config()).model.embed_tokens.weight


@pytest.mark.parametrize("field, value", [("use_gemma_norm", "no"), ("use_qk_norm", 1), ("tie_word_embeddings", None)])
def test_the_boolean_options_refuse_other_values(field, value):
    with pytest.raises(ValueError, match=f"{field} must be true or false, got {value!r}"):
        tiny_config(**{field: value})


def test_the_options_survive_save_and_reload(tmp_path):
    config = tiny_config(hidden_act="silu_and_mul", use_gemma_norm=False, use_qk_norm=False, rotary_dim=None,
                         partial_rotary_factor=1.0, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    reloaded = type(config).from_pretrained(tmp_path)
    assert (reloaded.hidden_act, reloaded.use_gemma_norm, reloaded.use_qk_norm, reloaded.rotary_dim,
            reloaded.tie_word_embeddings) == ("silu_and_mul", False, False, 32, True)


# ------------------------------------------------------------------ the conversion
@pytest.mark.parametrize("tied", [True, False])
def test_the_converted_model_computes_llamas_logits_in_dense_mode(tied):
    llama = random_llama(tie_word_embeddings=tied)
    converted = convert_llama(llama, **CONVERSION)
    config = converted.config
    assert config.layer_types == ["full_attention"] + ["minimax_m3_sparse"] * 3
    assert (config.index_n_heads, config.index_head_dim, config.indexer_backend) == (2, 8, "torch")
    assert (converted.lm_head.weight is converted.model.embed_tokens.weight) == tied
    ids = torch.randint(3, 101, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = llama(ids).logits
        converted.config.attention_mode = "dense"
        dense = converted(ids).logits
        converted.config.attention_mode = "sparse"
        sparse = converted(ids).logits
    assert expected.abs().max() > 1  # not a trivially small output
    torch.testing.assert_close(dense, expected, atol=1e-4, rtol=0)
    # beyond index_topk_blocks pages (12 tokens) the untrained indexer reads only some of them
    torch.testing.assert_close(sparse[:, :12], expected[:, :12], atol=1e-4, rtol=0)
    assert (sparse[:, 12:] - expected[:, 12:]).abs().max() > 1e-2


def test_only_the_new_indexer_is_not_llamas_and_it_follows_the_seed(tmp_path):
    llama = random_llama()
    first, again, other = (convert_llama(llama, seed=s, **CONVERSION) for s in (0, 0, 1))
    llama_names = set(llama.state_dict())
    for name, tensor in first.state_dict().items():
        if name in llama_names:
            assert torch.equal(tensor, llama.state_dict()[name]), name
        else:
            assert name.endswith(INDEXER_SUFFIXES), name
            assert torch.equal(tensor, again.state_dict()[name])
    assert not torch.equal(first.model.layers[2].self_attn.index_q_proj.weight,
                           other.model.layers[2].self_attn.index_q_proj.weight)
    first.save_pretrained(tmp_path)
    reloaded = MiniMaxM3ForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 101, (1, 30))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, first(ids).logits)


def test_index_geometry_and_overrides_are_the_callers():
    config = minimax_m3_config_from_llama(random_llama().config, first_sparse_layer=2, index_head_dim=16,
                                          indexer_backend="auto", index_dtype="bfloat16")
    assert config.layer_types[:2] == ["full_attention"] * 2 and config.index_head_dim == 16
    assert (config.indexer_backend, config.index_dtype, config.index_topk_blocks) == ("auto", "bfloat16", 16)
    assert math.isclose(config.rope_theta, 1e5) and config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("overrides, text", [
    (dict(attention_bias=True), "llama_config.attention_bias is true"),
    (dict(mlp_bias=True), "llama_config.mlp_bias is true"),
    (dict(hidden_act="gelu"), "llama_config.hidden_act must be 'silu'"),
])
def test_llama_features_the_architecture_lacks_raise(overrides, text):
    with pytest.raises(ValueError, match=text):
        minimax_m3_config_from_llama(LlamaConfig(**{**LLAMA, **overrides}))


def test_a_first_sparse_layer_beyond_the_model_raises():
    with pytest.raises(ValueError, match=r"first_sparse_layer must be in \[0, 4\], got 5"):
        minimax_m3_config_from_llama(LlamaConfig(**LLAMA), first_sparse_layer=5)
