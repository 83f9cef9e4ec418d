"""The decode step that CUDA graphs replay (``minimax_m3/decode_graphs.py``), run uncaptured on the CPU: every length
read from device buffers, dense attention over the static cache's capacity with a length mask, the page selector's
own plan re-planned on the device. It must give the ordinary forward's logits and page selections."""

import logging

import pytest
import torch

import minimax_m3.sparse_attention as sparse_attention
from minimax_m3 import MiniMaxM3StaticCache
from test_minimax_m3 import tiny_model

GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.fixture
def recorded_selections(monkeypatch):
    """Every selection the page selectors return, with whether it came from a decode step's device-only plan."""
    records = []
    select = sparse_attention.PageSelector.select

    def recording(self, layer_cache_pages, block_table, index_q, metadata):
        selection = select(self, layer_cache_pages, block_table, index_q, metadata)
        if metadata.step is None or metadata.step.selector is self:
            records.append((metadata.step is not None, selection.clone()))
        return selection

    monkeypatch.setattr(sparse_attention.PageSelector, "select", recording)
    return records


def decode(model, prompt, mask, steps, graphs):
    """Greedy steps after a prefill over a static cache; the per-step logits ``[steps, B, vocab]``."""
    cache = MiniMaxM3StaticCache(model.config, max_cache_len=prompt.shape[1] + steps)
    with torch.no_grad():
        output = model(prompt, attention_mask=mask, past_key_values=cache)
        token = output.logits[:, -1:].argmax(-1)
        logits = []
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            output = model(token, attention_mask=mask, past_key_values=cache, decode_cuda_graphs=graphs)
            logits.append(output.logits[:, -1])
            token = output.logits[:, -1:].argmax(-1)
    return torch.stack(logits)


@pytest.mark.parametrize("attention_mode", ["sparse", "dense"])
def test_the_device_only_step_gives_the_ordinary_forwards_logits_and_pages(recorded_selections, attention_mode):
    model = tiny_model(attention_mode=attention_mode)
    prompt = torch.randint(3, 97, (2, 45), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompt)
    mask[1, :13] = 0  # left padding: the sequences' lengths differ by 13
    steps = 14  # up to 58 tokens: 8 pages of 8, of which the sparse layers keep 3
    expected = decode(model, prompt, mask, steps, graphs=False)
    eager_records = list(recorded_selections)
    recorded_selections.clear()
    stepped = decode(model, prompt, mask, steps, graphs=True)
    assert model.model._decode_graphs, "the step path was not taken"
    torch.testing.assert_close(stepped, expected, atol=1e-5, rtol=1e-5)
    if attention_mode == "sparse":
        assert [from_step for from_step, _ in recorded_selections] == [False] * 2 + [True] * (2 * steps)
        assert len(eager_records) == len(recorded_selections)
        for (_, ours), (_, theirs) in zip(recorded_selections, eager_records):
            assert torch.equal(ours, theirs)
        last = recorded_selections[-1][1]  # 58 and 45 tokens: 8 and 6 pages, 3 kept per (token, group)
        assert last.shape[-1] == 3 and int(last.max()) == 7 and bool((last >= 0).all())


def test_generate_with_decode_graphs_gives_the_eager_tokens_greedy_and_beam():
    model = tiny_model()
    prompt = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[0, :9] = 0
    for extra in ({}, {"num_beams": 2}):
        eager = model.generate(prompt, attention_mask=mask, max_new_tokens=16, decode_cuda_graphs=False, **GREEDY, **extra)
        graphed = model.generate(prompt, attention_mask=mask, max_new_tokens=16, decode_cuda_graphs=True, **GREEDY, **extra)
        assert torch.equal(graphed, eager), extra
    assert model.model._decode_graphs


def test_a_step_the_graph_cannot_serve_runs_eagerly_and_says_why(caplog):
    model = tiny_model(experts_implementation="eager")
    prompt = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.WARNING, logger="minimax_m3.modeling_minimax_m3"):
        graphed = model.generate(prompt, max_new_tokens=4, decode_cuda_graphs=True, **GREEDY)
    assert not model.model._decode_graphs
    assert "experts_implementation='eager' synchronises" in caplog.text
    assert torch.equal(graphed, model.generate(prompt, max_new_tokens=4, decode_cuda_graphs=False, **GREEDY))


def test_a_full_static_cache_raises_naming_its_capacity():
    model = tiny_model()
    cache = MiniMaxM3StaticCache(model.config, max_cache_len=24)  # three pages of 8
    with torch.no_grad():
        model(torch.randint(3, 97, (1, 24)), past_key_values=cache)
        with pytest.raises(ValueError, match="holds 24 tokens per sequence"):
            model(torch.randint(3, 97, (1, 1)), past_key_values=cache, decode_cuda_graphs=True)


def test_moving_the_model_drops_its_captured_steps_and_offloaded_models_decode_eagerly(caplog):
    """A graph reads the addresses of the tensors it was captured with: ``to()`` (any ``_apply``) must drop it, and
    accelerate's hooks, which move weights during the forward, keep the steps eager."""
    from accelerate import cpu_offload

    model = tiny_model()
    prompt = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(3))
    expected = model.generate(prompt, max_new_tokens=4, decode_cuda_graphs=False, **GREEDY)
    assert torch.equal(model.generate(prompt, max_new_tokens=4, decode_cuda_graphs=True, **GREEDY), expected)
    assert model.model._decode_graphs
    model.to(torch.float64).to(torch.float32)
    assert not model.model._decode_graphs
    cpu_offload(model, execution_device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="minimax_m3.modeling_minimax_m3"):
        offloaded = model.generate(prompt, max_new_tokens=4, decode_cuda_graphs=True, **GREEDY)
    assert torch.equal(offloaded, expected) and not model.model._decode_graphs
    assert "accelerate's hooks" in caplog.text


def test_the_decode_bench_reports_the_step_and_its_operators(capsys):
    from minimax_m3 import bench_decode

    bench_decode.main(["--tiny", "--context", "200", "--batch", "2", "--steps", "2", "--top", "5", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "sparse, context 200, batch 2, graphs on cpu:" in printed and "ms per step" in printed
    assert printed.count("\n| aten::") == 5


def test_continuing_a_static_graphed_generation_for_more_tokens_reallocates_its_cache_once():
    """generate's CUDA default is a static cache sized for the call; continued for more tokens, it grows once (its
    tensors move, so the decode graph is captured again) and gives the tokens of one longer generation."""
    from test_minimax_m3 import CACHE_FIELD

    model = tiny_model()
    prompt = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    whole = model.generate(prompt, max_new_tokens=12, decode_cuda_graphs=True, **GREEDY)
    first = model.generate(prompt, max_new_tokens=4, decode_cuda_graphs=True, return_dict_in_generate=True, **GREEDY)
    cache = first[CACHE_FIELD]
    assert isinstance(cache, MiniMaxM3StaticCache) and cache.capacity == 40  # 34 tokens in pages of 8
    continued = model.generate(first.sequences, max_new_tokens=8, decode_cuda_graphs=True, **{CACHE_FIELD: cache},
                               **GREEDY)
    assert cache.capacity == 48 and torch.equal(continued, whole)
    assert model.model._decode_graphs[2].serves(cache)
