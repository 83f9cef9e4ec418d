"""The MiniMax-M3 caches as transformers' generation uses them (CPU, tiny config whose sparse layers drop pages):
a ``transformers.Cache`` with one layer object per layer type, continued by ``generate``, the standard methods,
assisted and prompt-lookup decoding, beam search, and the static variant whose tensors never move."""

import pytest
import torch
from transformers import Cache, DynamicCache

from minimax_m3 import MiniMaxM3Cache, MiniMaxM3StaticCache
from minimax_m3.cache import MiniMaxM3CacheLayer, MiniMaxM3SparseCacheLayer
from test_minimax_m3 import CACHE_FIELD, tiny_model

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt(length=30, batch=2, seed=0):
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_cache_is_a_transformers_cache_with_one_layer_object_per_layer_type(model):
    ids = prompt()
    output = model(ids, use_cache=True)
    cache = output[CACHE_FIELD]
    assert isinstance(cache, Cache) and len(cache) == model.config.num_hidden_layers
    for kind, layer in zip(model.config.layer_types, cache.layers):
        sparse = kind == "minimax_m3_sparse"
        assert type(layer) is (MiniMaxM3SparseCacheLayer if sparse else MiniMaxM3CacheLayer)
        assert (layer.index_keys is not None) == sparse if sparse else not hasattr(layer, "index_keys")
        assert layer.keys.shape[:2] == (2, cache.capacity) and layer.get_seq_length() == 30
    assert cache.get_seq_length() == 30 and cache.batch_size == 2 and not cache.is_compileable


def test_generate_builds_our_cache_and_continues_a_returned_one(model):
    ids = prompt()
    whole = model.generate(ids, max_new_tokens=6, **GREEDY)
    first = model.generate(ids, max_new_tokens=3, return_dict_in_generate=True, **GREEDY)
    cache = first[CACHE_FIELD]
    assert isinstance(cache, MiniMaxM3Cache) and cache.get_seq_length() == 32  # the last token is not run yet
    continued = model.generate(first.sequences, max_new_tokens=3, **{CACHE_FIELD: cache}, **GREEDY)
    assert torch.equal(continued, whole)


def test_crop_then_continue_equals_running_the_shorter_prefix(model):
    ids = prompt(40)
    cache = model(ids, use_cache=True)[CACHE_FIELD]
    cache.crop(-8)
    assert cache.lengths == [32, 32] and cache.columns_seen == 32
    continued = model(ids[:, 32:], past_key_values=cache).logits
    torch.testing.assert_close(continued, model(ids).logits[:, 32:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot crop 33 tokens"):
        model(ids[:, :32], use_cache=True)[CACHE_FIELD].crop(-33)


@pytest.mark.parametrize("method", ["reorder_cache", "batch_select_indices", "batch_repeat_interleave"])
def test_sequence_selection_methods_keep_each_sequence_with_its_own_history(model, method):
    ids = prompt(30, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # a left-padded row: its history has other lengths
    cache = model(ids[:, :24], attention_mask=mask[:, :24], use_cache=True)[CACHE_FIELD]
    if method == "batch_repeat_interleave":
        cache.batch_repeat_interleave(2)
        order = torch.tensor([0, 0, 1, 1, 2, 2])
    else:
        order = torch.tensor([2, 0, 1]) if method == "reorder_cache" else torch.tensor([2, 1])
        getattr(cache, method)(order)
    assert cache.batch_size == len(order)
    got = model(ids[order, 24:], attention_mask=mask[order], past_key_values=cache).logits
    expected = model(ids[order], attention_mask=mask[order]).logits[:, 24:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_assisted_and_prompt_lookup_decoding_give_the_greedy_tokens(model, monkeypatch):
    crops = []
    crop = MiniMaxM3Cache.crop
    monkeypatch.setattr(MiniMaxM3Cache, "crop", lambda self, n: (crops.append(n), crop(self, n))[1])
    ids = prompt(30, batch=1)
    greedy = model.generate(ids, max_new_tokens=8, **GREEDY)
    assistant = tiny_model(seed=1)  # a different model: some candidates are rejected and cropped
    assisted = model.generate(ids, max_new_tokens=8, assistant_model=assistant, **GREEDY)
    lookup = model.generate(ids, max_new_tokens=8, prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(assisted, greedy) and torch.equal(lookup, greedy)
    assert any(n != 0 for n in crops)  # rejected candidates were really cropped


def test_beam_search_reorders_the_cache(model):
    ids = prompt(30, batch=2)
    beams = model.generate(ids, max_new_tokens=5, num_beams=3, **GREEDY)
    static = model.generate(ids, max_new_tokens=5, num_beams=3, cache_implementation="static", **GREEDY)
    assert torch.equal(beams, static)
    # beam search over the model's scores, recomputed without a cache for each kept beam
    scores = model.generate(ids, max_new_tokens=5, num_beams=3, output_scores=True, return_dict_in_generate=True,
                            **GREEDY)
    assert torch.equal(scores.sequences, beams)


def test_the_static_cache_keeps_its_tensors_where_they_are_and_gives_the_dynamic_result(model):
    ids = prompt(30)
    dynamic = model.generate(ids, max_new_tokens=6, **GREEDY)
    out = model.generate(ids, max_new_tokens=6, cache_implementation="static", return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, dynamic)
    cache = out[CACHE_FIELD]
    assert isinstance(cache, MiniMaxM3StaticCache) and cache.capacity == 40  # 36 tokens in pages of 8

    static = MiniMaxM3StaticCache(model.config, max_cache_len=44)
    model(ids[:, :20], past_key_values=static, use_cache=True)
    addresses = [tensor.data_ptr() for layer in static.layers for _, tensor in layer.tensors()]
    table = static.block_table(ids.device).data_ptr()
    for step in range(20, 30):
        model(ids[:, step : step + 1], past_key_values=static, use_cache=True)
    static.reorder_cache(torch.tensor([1, 0]))
    assert [tensor.data_ptr() for layer in static.layers for _, tensor in layer.tensors()] == addresses
    assert static.block_table(ids.device).data_ptr() == table and static.get_seq_length() == 30
    with pytest.raises(ValueError, match="the static cache holds 48 tokens per sequence"):
        model(prompt(20), past_key_values=static, use_cache=True)


def test_caches_the_model_cannot_use_raise(model):
    ids = prompt()
    with pytest.raises(TypeError, match="must be a MiniMaxM3Cache"):
        model(ids, past_key_values=DynamicCache())
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not served"):
        model.generate(ids, max_new_tokens=2, cache_implementation="offloaded", **GREEDY)
    with pytest.raises(TypeError, match="update"):
        MiniMaxM3Cache(model.config).layers[0].update(torch.zeros(1), torch.zeros(1))
