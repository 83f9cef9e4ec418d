"""Bad model inputs raise a ValueError that names the argument, before anything is written to the cache (CPU, tiny
config, sparse and dense attention): ids out of the vocabulary or of the wrong dtype/shape, ``inputs_embeds`` of the
wrong shape/dtype, a cache built from another config, empty input, and sequences beyond ``max_position_embeddings``
with the default RoPE (RoPE scalings run beyond it)."""

import pytest
import torch

from minimax_m3 import MiniMaxM3Cache, MiniMaxM3StaticCache
from test_minimax_m3 import SPARSE_CONFIG, tiny_config, tiny_model

MODES = ["sparse", "dense"]
VOCAB = 97


@pytest.fixture(scope="module", params=MODES)
def model(request):
    return tiny_model(attention_mode=request.param)


def ids(batch=2, length=12, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def snapshot(cache):
    tensors = [tensor.clone() for layer in cache.layers for _, tensor in layer.tensors()]
    return list(cache.lengths), cache.columns_seen, cache.batch_size, cache.capacity, tensors


def filled_cache(model, length=10, static=False):
    cache = MiniMaxM3StaticCache(model.config, max_cache_len=64) if static else MiniMaxM3Cache(model.config)
    with torch.no_grad():
        model(ids(length=length, seed=1), past_key_values=cache)
    return cache


def assert_refused(model, cache, names, match=None, **inputs):
    """The call raises a ValueError naming ``names`` (and matching ``match``), and ``cache`` is as it was."""
    before = snapshot(cache)
    with torch.no_grad(), pytest.raises(ValueError, match=match) as raised:
        model(past_key_values=cache, **inputs)
    message = str(raised.value)
    for name in [names] if isinstance(names, str) else names:
        assert name in message, message
    lengths, columns, batch, capacity, tensors = snapshot(cache)
    assert (lengths, columns, batch, capacity) == before[:4]
    assert all(torch.equal(a, b) for a, b in zip(tensors, before[4])) and len(tensors) == len(before[4])
    return message


# ------------------------------------------------------------------ input_ids
@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 100, -1])
def test_ids_out_of_the_vocabulary_raise_on_cpu(model, bad_id):
    given = ids()
    given[1, 5] = bad_id
    for cache in (MiniMaxM3Cache(model.config), filled_cache(model)):
        message = assert_refused(model, cache, "input_ids", input_ids=given)
        assert f"vocab_size = {VOCAB}" in message and str(bad_id) in message


@pytest.mark.parametrize("given", [ids().float(), ids()[0], ids()[None], ids().to(torch.int16), ids().bool(),
                                   [[3, 4, 5]]], ids=["float", "1-D", "3-D", "int16", "bool", "list"])
def test_ids_of_another_dtype_or_rank_raise(model, given):
    message = assert_refused(model, filled_cache(model), "input_ids", match=r"\[batch, new tokens\]", input_ids=given)
    assert "got" in message


def test_a_float_decode_step_is_refused_before_the_graph_path(model):
    cache = filled_cache(model, static=True)
    step = dict(decode_cuda_graphs=True, attention_mask=torch.ones(2, 11, dtype=torch.long))
    assert_refused(model, cache, "input_ids", input_ids=torch.full((2, 1), 5.0), **step)
    assert_refused(model, cache, "input_ids", input_ids=torch.full((2, 1), VOCAB), **step)
    assert all(graph._cache() is not cache for graph in model.model._decode_graphs.values())


# ------------------------------------------------------------------ inputs_embeds
@pytest.mark.parametrize("shape, dtype, match", [
    ((2, 12, 32), torch.float32, "hidden_size = 64"),
    ((24, 64), torch.float32, "hidden_size = 64"),
    ((2, 12, 64), torch.float64, "torch.float32"),
    ((2, 12, 64), torch.bfloat16, "torch.float32"),
    ((2, 12, 64), torch.long, "torch.float32"),
], ids=["hidden", "2-D", "float64", "bfloat16", "int64"])
def test_inputs_embeds_of_another_shape_or_dtype_raise(model, shape, dtype, match):
    embeds = torch.ones(shape, dtype=dtype)
    for cache in (MiniMaxM3Cache(model.config), filled_cache(model)):
        message = assert_refused(model, cache, "inputs_embeds", match=match, inputs_embeds=embeds)
        assert str(tuple(shape)) in message or str(dtype) in message


def test_inputs_embeds_of_another_dtype_run_under_autocast(model):
    embeds = model.get_input_embeddings()(ids())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(inputs_embeds=embeds.bfloat16()).logits
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------------ past_key_values
OTHER_CONFIGS = {
    "num_hidden_layers": dict(num_hidden_layers=2, moe_layer_freq=[0, 1],
                              sparse_attention_config={**SPARSE_CONFIG, "sparse_attention_freq": [0, 1]}),
    "num_key_value_heads": dict(num_key_value_heads=1,
                                sparse_attention_config={**SPARSE_CONFIG, "sparse_num_index_heads": 1}),
    "head_dim": dict(head_dim=16, rotary_dim=8),
    "index_head_dim": dict(sparse_attention_config={**SPARSE_CONFIG, "sparse_index_dim": 16}),
    "index_block_size": dict(sparse_attention_config={**SPARSE_CONFIG, "sparse_block_size": 16}),
    "layer_types": dict(sparse_attention_config={**SPARSE_CONFIG, "sparse_attention_freq": [0, 0, 1]}),
}


@pytest.mark.parametrize("field", sorted(OTHER_CONFIGS))
def test_a_cache_built_from_another_config_raises(model, field):
    other = tiny_config(attention_mode=model.config.attention_mode, **OTHER_CONFIGS[field])
    assert getattr(other, field) != getattr(model.config, field)
    fresh = MiniMaxM3Cache(other)
    filled = filled_cache(tiny_model(**OTHER_CONFIGS[field], attention_mode=model.config.attention_mode))
    for cache in (fresh, filled, MiniMaxM3StaticCache(other, max_cache_len=64)):
        message = assert_refused(model, cache, ["past_key_values", field], input_ids=ids())
        assert str(getattr(other, field)) in message
    # the decode-step path checks the cache too
    static = MiniMaxM3StaticCache(other, max_cache_len=64, batch_size=2)
    static.lengths[:] = [10, 10]
    assert_refused(model, static, "past_key_values", input_ids=ids(length=1), decode_cuda_graphs=True)


def test_a_cache_of_another_batch_raises(model):
    assert_refused(model, filled_cache(model), "past_key_values", match="holds 2 sequences", input_ids=ids(batch=3))


def test_a_cache_of_an_equal_config_gives_the_same_logits(model):
    """A cache of another config object with the same layout (e.g. a reloaded config) is accepted."""
    equal = tiny_config(attention_mode=model.config.attention_mode)
    assert equal is not model.config
    with torch.no_grad():
        expected = model(ids(), past_key_values=MiniMaxM3Cache(model.config)).logits
        got = model(ids(), past_key_values=MiniMaxM3Cache(equal)).logits
    assert torch.equal(got, expected)


# ------------------------------------------------------------------ empty input
@pytest.mark.parametrize("shape", [(2, 0), (0, 12)], ids=["no columns", "no rows"])
def test_empty_input_raises_in_every_mode(model, shape):
    fresh = MiniMaxM3Cache(model.config)
    assert_refused(model, fresh, "input_ids", match="at least one new token", input_ids=torch.zeros(shape, dtype=torch.long))
    assert fresh.batch_size is None and fresh.lengths == []
    if shape[0] == 2:
        cache = filled_cache(model)
        assert_refused(model, cache, "input_ids", input_ids=torch.zeros(shape, dtype=torch.long),
                       attention_mask=torch.ones(2, 10, dtype=torch.long))
        assert_refused(model, cache, "inputs_embeds", match="at least one new token",
                       inputs_embeds=torch.zeros(*shape, 64))
    with torch.no_grad(), pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(*shape, 64))  # without a cache too


def test_a_mask_with_no_real_new_token_raises_in_every_mode(model):
    fresh = MiniMaxM3Cache(model.config)
    assert_refused(model, fresh, "attention_mask", input_ids=ids(), attention_mask=torch.zeros(2, 12, dtype=torch.long))
    assert fresh.batch_size is None
    cache = filled_cache(model)
    mask = torch.cat([torch.ones(2, 10, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)], dim=1)
    assert_refused(model, cache, "attention_mask", input_ids=ids(length=4), attention_mask=mask)
    embeds = model.get_input_embeddings()(ids(length=4)).detach()
    assert_refused(model, cache, "attention_mask", inputs_embeds=embeds, attention_mask=mask)


def test_a_row_without_new_tokens_still_runs_beside_one_with_them(model):
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0] = 0
    cache = filled_cache(model)
    with torch.no_grad():
        logits = model(ids(), attention_mask=torch.cat([torch.ones(2, 10, dtype=torch.long), mask], 1),
                       past_key_values=cache).logits
    assert torch.isfinite(logits).all() and cache.lengths == [10, 22]


# ------------------------------------------------------------------ max_position_embeddings
def test_default_rope_refuses_sequences_beyond_max_position_embeddings(model):
    short = tiny_model(attention_mode=model.config.attention_mode, max_position_embeddings=32)
    fresh = MiniMaxM3Cache(short.config)
    message = assert_refused(short, fresh, ["max_position_embeddings", "33"], input_ids=ids(length=33))
    assert "dynamic" in message and "yarn" in message
    cache = MiniMaxM3Cache(short.config)
    with torch.no_grad():
        short(ids(length=30), past_key_values=cache)
    assert_refused(short, cache, ["max_position_embeddings", "34"], input_ids=ids(length=4))
    with torch.no_grad():  # up to the limit is fine, and padding is no position
        short(ids(length=32))
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[:, :8] = 0
        assert torch.isfinite(short(ids(length=40), attention_mask=mask).logits).all()


def test_a_decode_step_beyond_max_position_embeddings_raises(model):
    short = tiny_model(attention_mode=model.config.attention_mode, max_position_embeddings=32)
    cache = MiniMaxM3StaticCache(short.config, max_cache_len=64)
    with torch.no_grad():
        short(ids(length=32), past_key_values=cache)
    for graphs in (True, False):
        assert_refused(short, cache, ["max_position_embeddings", "33"], input_ids=ids(length=1),
                       decode_cuda_graphs=graphs)


def test_chunked_prefill_beyond_max_position_embeddings_raises_before_the_first_chunk():
    short = tiny_model(max_position_embeddings=32, max_score_buffer_bytes=4 * 2 * 2 * 7 * 9)
    assert short.model._query_chunk_columns(MiniMaxM3Cache(short.config, 2), [40, 40], 40) < 40
    assert_refused(short, MiniMaxM3Cache(short.config), "max_position_embeddings", input_ids=ids(length=40))


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
    {"rope_type": "linear", "factor": 2.0},
], ids=lambda rope: rope["rope_type"])
def test_rope_scalings_run_beyond_max_position_embeddings(model, rope):
    scaled = tiny_model(attention_mode=model.config.attention_mode, max_position_embeddings=32, rope_parameters=rope)
    cache = MiniMaxM3Cache(scaled.config)
    with torch.no_grad():
        first = scaled(ids(length=30), past_key_values=cache).logits
        second = scaled(ids(length=20, seed=2), past_key_values=cache).logits
    assert torch.isfinite(first).all() and torch.isfinite(second).all() and cache.lengths == [50, 50]


# ------------------------------------------------------------------ valid inputs
def test_valid_inputs_give_the_same_logits_by_every_route(model):
    """int32 and int64 ids, ids and their embeddings, the causal LM and the bare model: one result."""
    given = ids()
    with torch.no_grad():
        expected = model(given).logits
        assert torch.equal(model(given.int()).logits, expected)
        assert torch.equal(model(inputs_embeds=model.get_input_embeddings()(given)).logits, expected)
        hidden = model.model(given).last_hidden_state
        assert torch.equal(model.lm_head(hidden).float(), expected)
    with pytest.raises(ValueError, match="input_ids"), torch.no_grad():
        model.model(given.float())  # the bare model validates as well


def test_validation_failures_leave_the_cache_usable(model):
    """After refused calls the cache continues as if they never happened."""
    given = ids(length=16)
    with torch.no_grad():
        expected = model(given).logits[:, 10:]
        cache = filled_cache(model)
        cache.reset()
        model(given[:, :10], past_key_values=cache)
        for bad in (dict(input_ids=torch.full((2, 3), VOCAB)), dict(input_ids=given[:, 10:].float()),
                    dict(input_ids=given[:, :0]), dict(inputs_embeds=torch.zeros(2, 6, 32))):
            with pytest.raises(ValueError):
                model(past_key_values=cache, **bad)
        got = model(given[:, 10:], past_key_values=cache).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
