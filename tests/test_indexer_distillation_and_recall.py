"""The indexer's training target and loss (attention mass per page, KL) and its recall, on constructed cases
and on the embedded tiny model (pages of 16 tokens, top-4)."""

import pytest
import torch

import minimax_m3  # noqa: F401
from eval.default_model import _initialise, tiny_config
from eval.indexer_distillation import (history_page_kl, indexer_distillation_loss, indexer_parameter_names,
                                      page_distribution_kl)
from eval.layer_inputs import capture_sparse_layer_inputs
from eval.modes import attention_mode
from eval.recall import RecallAccumulator, indexer_recall
from minimax_m3 import MiniMaxM3ForCausalLM
from minimax_m3.dense_attention import dense_attention
from minimax_m3.sparse_attention import ForwardMetadata, dense_attention_page_mass


@pytest.fixture(scope="module")
def tiny_model():
    model = MiniMaxM3ForCausalLM(tiny_config()).float()
    _initialise(model)
    return model.eval()


def one_sequence_metadata(tokens):
    return ForwardMetadata(batch_index=torch.zeros(tokens, dtype=torch.long), positions=torch.arange(tokens),
                           query_lengths=[tokens], kv_lengths=[tokens], query_starts=[0])


def random_attention_inputs(tokens=45, heads=4, groups=2, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=generator, dtype=torch.float64)
    keys = torch.randn(tokens, groups, dim, generator=generator, dtype=torch.float64)
    values = torch.randn(tokens, groups, dim, generator=generator, dtype=torch.float64)
    return q, keys, values


def test_page_mass_is_dense_attention_split_by_page():
    q, keys, values = random_attention_inputs()
    positions = torch.arange(q.shape[0])
    mass = dense_attention_page_mass(q, keys, positions, scale=0.3, page_size=8, chunk_elements=500)
    assert mass.shape == (45, 2, 6)
    causal_pages = positions // 8 + 1
    after = torch.arange(6)[None, :] >= causal_pages[:, None]
    assert torch.all(mass.permute(0, 2, 1)[after] == 0)
    torch.testing.assert_close(mass.sum(-1), torch.ones(45, 2, dtype=torch.float64))
    # pages of one key: the per-key probabilities, which weight the values into the model's own dense attention
    per_key = dense_attention_page_mass(q, keys, positions, scale=0.3, page_size=1)
    attended = dense_attention(q, keys[None], values[None], one_sequence_metadata(45), scale=0.3)  # [T, H, D]
    group_mean = attended.view(45, 2, 2, 8).mean(2)
    torch.testing.assert_close(torch.einsum("tgs,sgd->tgd", per_key, values), group_mean)


def test_kl_is_zero_when_the_indexer_distribution_is_the_attention_mass():
    q, keys, _ = random_attention_inputs(seed=1)
    positions = torch.arange(q.shape[0])
    mass = dense_attention_page_mass(q, keys, positions, scale=0.5, page_size=8)
    causal = torch.arange(mass.shape[2])[None, None, :] < (positions // 8 + 1)[:, None, None]
    # log-mass on the causal pages plus any per-row constant, -inf after them: softmax gives back the mass
    offset = torch.randn(mass.shape[0], mass.shape[1], 1, dtype=torch.float64)
    scores = torch.where(causal, mass.log() + offset, float("-inf")).requires_grad_(True)
    kl = page_distribution_kl(scores, mass)
    assert kl.shape == mass.shape[:2]
    torch.testing.assert_close(kl, torch.zeros_like(kl), atol=1e-12, rtol=0)
    kl.sum().backward()
    assert torch.isfinite(scores.grad).all()
    torch.testing.assert_close(scores.grad, torch.zeros_like(scores.grad), atol=1e-12, rtol=0)
    # any other distribution is farther away
    other = torch.where(causal, torch.randn_like(mass), float("-inf"))
    assert torch.all(page_distribution_kl(other, mass)[positions >= 8] > 0)


def test_history_kl_is_the_history_mass_times_the_kl_of_the_history_shares_per_choosing_row():
    q, keys, _ = random_attention_inputs(seed=4)
    positions = torch.arange(q.shape[0])
    mass = dense_attention_page_mass(q, keys, positions, scale=0.5, page_size=4)  # [45, 2, 12]
    local = positions // 4
    causal = torch.arange(mass.shape[2])[None, None, :] <= local[:, None, None]
    scores = torch.where(causal, torch.randn(mass.shape, dtype=torch.float64,
                                             generator=torch.Generator().manual_seed(5)), float("-inf"))
    scores.requires_grad_(True)
    selected_history = 3
    kl = history_page_kl(scores, mass, local, selected_history)
    assert kl.shape == mass.shape[:2]
    for t in range(mass.shape[0]):
        for h in range(mass.shape[1]):
            pages = int(local[t])
            if pages <= selected_history:
                assert kl[t, h] == 0  # the top-k takes every history page
                continue
            history = mass[t, h, :pages]
            share = history / history.sum()
            prediction = torch.softmax(scores[t, h, :pages].detach(), 0)
            expected = history.sum() * (share * (share / prediction).log()).sum()
            torch.testing.assert_close(kl[t, h], expected, atol=1e-12, rtol=1e-10)
    kl.sum().backward()
    assert torch.isfinite(scores.grad).all()
    # neither the local page's score nor a short row's scores move the objective
    assert torch.all(scores.grad[torch.arange(45), :, local] == 0)
    assert torch.all(scores.grad[local <= selected_history] == 0)


def test_history_kl_is_zero_for_the_history_shares_and_for_a_row_whose_mass_is_local():
    mass = torch.zeros(3, 1, 8, dtype=torch.float64)
    mass[0, 0, :7] = torch.tensor([0.1, 0.2, 0.05, 0.05, 0.1, 0.1, 0.4])  # local page 6
    mass[1, 0, 6] = 1.0  # everything on the local page
    mass[2, 0, :8] = 1 / 8  # local page 7
    local = torch.tensor([6, 6, 7])
    scores = torch.full_like(mass, float("-inf"))
    scores[0, 0, :6] = mass[0, 0, :6].log() + 3.0  # any per-row offset
    scores[0, 0, 6] = -50.0  # the local page's score is not read
    scores[1, 0, :7] = torch.randn(7, dtype=torch.float64)
    scores[2, 0, :8] = torch.randn(8, dtype=torch.float64)
    kl = history_page_kl(scores, mass, local, 2)
    torch.testing.assert_close(kl[:2], torch.zeros(2, 1, dtype=torch.float64), atol=1e-12, rtol=0)
    assert kl[2, 0] > 0
    with pytest.raises(ValueError, match="local_pages"):
        history_page_kl(scores, mass, local[:2], 2)


@pytest.mark.parametrize("objective", ["pages", "history"])
def test_distillation_loss_trains_only_the_indexer(tiny_model, objective):
    ids = torch.randint(3, 512, (2, 100), generator=torch.Generator().manual_seed(2))
    tiny_model.zero_grad(set_to_none=True)
    loss, per_layer = indexer_distillation_loss(tiny_model, ids, objective)
    assert sorted(per_layer) == [1, 2] and loss.item() > 0
    torch.testing.assert_close(loss.item(), sum(per_layer.values()), rtol=1e-6, atol=0)
    loss.backward()
    with_gradient = {name for name, p in tiny_model.named_parameters() if p.grad is not None}
    assert with_gradient == set(indexer_parameter_names(tiny_model))
    assert len(with_gradient) == 8  # index q/k projections and norms of the two sparse layers
    tiny_model.zero_grad(set_to_none=True)
    assert tiny_model.config.attention_mode == "sparse"  # the dense forward's mode was restored


def test_recall_is_one_when_every_page_is_selected(tiny_model):
    ids = torch.randint(3, 512, (2, 64), generator=torch.Generator().manual_seed(3))  # 4 pages of 16 <= top-4
    mask = torch.ones_like(ids)
    mask[1, :11] = 0  # left padding
    for attention_mask in (None, mask):
        for layer in indexer_recall(tiny_model, ids, attention_mask):
            assert layer.rows_beyond_topk == 0 and layer.recall_beyond_topk is None
            assert layer.recall == pytest.approx(1.0, abs=1e-6)


def kept_mass_by_loop(model, ids):
    """Per sparse layer, ``{(token, group): kept mass}`` of ``model``'s own selections on the one sequence ``ids``,
    one softmax per (token, head) (pages of 16), with the selections and the layers' inputs."""
    with capture_sparse_layer_inputs(model) as captured, torch.no_grad():
        output = model(ids, output_page_selections=True)
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    layers = []
    for layer_input, selection in zip(captured, output.page_selections):
        attention = layer_input.attention
        with torch.no_grad():
            q, k, _ = attention.query_key_value(layer_input.x, layer_input.cos, layer_input.sin)
        kept_by_row = {}
        for t in range(ids.shape[1]):
            for g in range(config.num_key_value_heads):
                pages = [p for p in selection[0, t, g].tolist() if p >= 0]
                in_selection = torch.tensor([j // 16 in pages for j in range(t + 1)])
                kept = 0.0
                for h in range(g * group, (g + 1) * group):
                    probabilities = torch.softmax((k[: t + 1, g] @ q[t, h]) * attention.scale, dim=0)
                    kept += float(probabilities[in_selection].sum()) / group
                kept_by_row[t, g] = kept
        layers.append((layer_input, selection, kept_by_row))
    return layers


def test_recall_beyond_the_window_matches_a_loop_over_tokens(tiny_model):
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(4))
    recall = indexer_recall(tiny_model, ids)
    config = tiny_model.config
    for layer, (_, _, kept_by_row) in zip(recall, kept_mass_by_loop(tiny_model, ids)):
        kept_all = list(kept_by_row.values())
        kept_beyond = [kept for (t, _), kept in kept_by_row.items() if t // 16 + 1 > config.index_topk_blocks]
        assert layer.rows == 300 and layer.rows_beyond_topk == len(kept_beyond) > 0
        assert layer.recall == pytest.approx(sum(kept_all) / len(kept_all), abs=1e-5)
        assert layer.recall_beyond_topk == pytest.approx(sum(kept_beyond) / len(kept_beyond), abs=1e-5)
        assert layer.recall_beyond_topk < 1.0
        assert layer.recall_at_answer is None and layer.answer_rows == 0  # no answer rows given


def test_recall_at_the_answer_averages_only_the_answer_rows(tiny_model):
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(5))
    answer_rows = torch.arange(140, 150)
    accumulator = RecallAccumulator()
    for layer_input, selection, kept_by_row in kept_mass_by_loop(tiny_model, ids):
        accumulator.add(layer_input, selection[0], answer_rows=answer_rows)
        expected = [kept for (t, _), kept in kept_by_row.items() if t >= 140]
        layer = accumulator.result()[-1]
        assert layer.answer_rows == len(expected) == 10 * tiny_model.config.num_key_value_heads
        assert layer.recall_at_answer == pytest.approx(sum(expected) / len(expected), abs=1e-5)
        assert layer.recall == pytest.approx(sum(kept_by_row.values()) / len(kept_by_row), abs=1e-5)
    with pytest.raises(ValueError, match="answer_rows must be a 1-D tensor of packed token indices in \\[0, 150\\)"):
        accumulator.add(layer_input, selection[0], answer_rows=torch.tensor([149, 150]))


def test_recall_needs_the_sparse_mode(tiny_model):
    with attention_mode(tiny_model, "dense"), pytest.raises(ValueError, match="sparse attention mode"):
        indexer_recall(tiny_model, torch.ones(1, 8, dtype=torch.long))


def test_full_attention_layers_have_no_indexer(tiny_model):
    attention = tiny_model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="full-attention layer"):
        attention.index_query_key(torch.zeros(1, 64), torch.zeros(1, 8), torch.zeros(1, 8))
