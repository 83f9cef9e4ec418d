"""The attention oracle (``eval.oracle_selection``) on the embedded tiny model (pages of 16, top-4): it selects the
history pages of the most dense attention mass, computed here by a loop of per-head softmaxes."""

import pytest
import torch

import minimax_m3  # noqa: F401
from eval import retrieval_accuracy
from eval.default_model import _initialise, tiny_config
from eval.layer_inputs import capture_sparse_layer_inputs
from eval.modes import attention_mode
from eval.oracle_selection import attention_oracle_selection
from eval.recall import indexer_recall
from minimax_m3 import MiniMaxM3Cache, MiniMaxM3ForCausalLM


@pytest.fixture(scope="module")
def tiny_model():
    model = MiniMaxM3ForCausalLM(tiny_config()).float()
    _initialise(model)
    return model.eval()


def page_mass_by_loop(attention, layer_input, token, group):
    """Dense attention mass per causal page of one (token, KV group) row: one float64 softmax per query head."""
    config = attention.config
    heads_per_group = config.num_attention_heads // config.num_key_value_heads
    with torch.no_grad():
        q, k, _ = attention.query_key_value(layer_input.x, layer_input.cos, layer_input.sin)
    pages = token // config.index_block_size + 1
    mass = torch.zeros(pages, dtype=torch.float64)
    for head in range(group * heads_per_group, (group + 1) * heads_per_group):
        logits = (k[: token + 1, group].double() @ q[token, head].double()) * attention.scale
        probabilities = torch.softmax(logits, dim=0)
        for page in range(pages):
            keys_of_page = slice(page * config.index_block_size, (page + 1) * config.index_block_size)
            mass[page] += float(probabilities[keys_of_page].sum())
    return mass / heads_per_group


def test_the_oracle_selects_the_pages_of_the_most_attention_mass(tiny_model):
    config = tiny_model.config
    topk, page_size = config.index_topk_blocks, config.index_block_size
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(7))
    with attention_mode(tiny_model, "sparse"), attention_oracle_selection(tiny_model), \
            capture_sparse_layer_inputs(tiny_model) as captured, torch.no_grad():
        output = tiny_model(ids, output_page_selections=True)
    rows_beyond = 0
    for layer_input, selection in zip(captured, output.page_selections):
        for token in range(0, ids.shape[1], 7):
            local = token // page_size
            for group in range(config.num_key_value_heads):
                pages = selection[0, token, group].tolist()
                if local + 1 <= topk:
                    assert pages == list(range(local + 1)) + [-1] * (topk - local - 1)
                    continue
                rows_beyond += 1
                assert pages[-1] == local and len(set(pages)) == topk
                mass = page_mass_by_loop(layer_input.attention, layer_input, token, group)[:local]
                chosen = torch.zeros(local, dtype=torch.bool)
                chosen[pages[:-1]] = True
                # the top-k ranks 16-bit levels of the row: masses closer than a level may swap
                level = float(mass.max()) / 65535
                assert float(mass[chosen].min()) >= float(mass[~chosen].max()) - 2 * level
    assert rows_beyond > 20


def test_no_indexer_keeps_more_attention_mass_than_the_oracle(tiny_model):
    ids = torch.randint(3, 512, (2, 160), generator=torch.Generator().manual_seed(8))
    with attention_mode(tiny_model, "sparse"):
        indexer = indexer_recall(tiny_model, ids)
        with attention_oracle_selection(tiny_model):
            oracle = indexer_recall(tiny_model, ids)
    for by_indexer, by_oracle in zip(indexer, oracle):
        assert by_oracle.recall_beyond_topk >= by_indexer.recall_beyond_topk - 1e-6
        assert by_oracle.recall_beyond_topk < 1.0  # top-4 of up to 10 pages cannot keep everything
    assert sum(layer.recall_beyond_topk for layer in oracle) > sum(layer.recall_beyond_topk for layer in indexer)


def test_over_a_cached_prefix_the_oracle_selects_as_in_one_forward(tiny_model):
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(9))
    with attention_mode(tiny_model, "sparse"), attention_oracle_selection(tiny_model), torch.no_grad():
        whole = tiny_model(ids, output_page_selections=True)
        cache = MiniMaxM3Cache(tiny_model.config, 1)
        tiny_model(ids[:, :100], past_key_values=cache, use_cache=True)
        continued = tiny_model(ids[:, 100:], past_key_values=cache, use_cache=True, output_page_selections=True)
    for one_forward, cached in zip(whole.page_selections, continued.page_selections):
        assert torch.equal(one_forward[:, 100:], cached)
    assert torch.allclose(whole.logits[:, 100:], continued.logits, atol=1e-4)


def test_the_oracle_variant_restores_the_model(tiny_model):
    ids = torch.randint(3, 512, (1, 90), generator=torch.Generator().manual_seed(10))
    with attention_mode(tiny_model, "sparse"), torch.no_grad():
        before = tiny_model(ids, output_page_selections=True)
        with retrieval_accuracy.variant(tiny_model, "attention-oracle") as model:
            oracle = model(ids, output_page_selections=True)
        after = tiny_model(ids, output_page_selections=True)
    assert any(not torch.equal(a, b) for a, b in zip(before.page_selections, oracle.page_selections))
    for a, b in zip(before.page_selections, after.page_selections):
        assert torch.equal(a, b)
    assert torch.equal(before.logits, after.logits)
    for layer in tiny_model.model.layers:
        assert "cache_index_keys_and_select" not in vars(layer.self_attn)


def test_dense_mode_under_the_oracle_is_dense(tiny_model):
    ids = torch.randint(3, 512, (1, 90), generator=torch.Generator().manual_seed(11))
    with attention_mode(tiny_model, "dense"), torch.no_grad():
        dense = tiny_model(ids).logits
        with attention_oracle_selection(tiny_model):
            oracle = tiny_model(ids).logits
    assert torch.equal(dense, oracle)


def test_unknown_variants_are_named():
    with pytest.raises(ValueError, match="attention-oracle"):
        with retrieval_accuracy.variant(None, "oracle"):
            pass
