"""Decode steps replayed as CUDA graphs (``minimax_m3/decode_graphs.py``) on the H200: the same logits and page
selections as the eager steps, no host synchronisation, and ``generate``'s default on CUDA; and a chunk of a chunked
prefill without a host synchronisation."""

import pytest
import torch

import minimax_m3.sparse_attention as sparse_attention
from minimax_m3 import MiniMaxM3StaticCache
from test_minimax_m3 import tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs SM90")]


def kernel_geometry_model(sparse_attention_freq):
    """32 query heads over 2 KV heads of 128 (16 per group), index heads of 128, pages of 128, top-16, bf16: the
    geometry the SM90 kernels (indexer, top-k and sparse attention) serve."""
    layers = len(sparse_attention_freq)
    model = tiny_model(
        hidden_size=256, num_attention_heads=32, num_key_value_heads=2, head_dim=128, rotary_dim=64,
        num_hidden_layers=layers, moe_layer_freq=[0] + [1] * (layers - 1), index_dtype="float8_e4m3fn",
        sparse_attention_config={"sparse_attention_freq": list(sparse_attention_freq), "sparse_num_index_heads": 2,
                                 "sparse_index_dim": 128, "sparse_block_size": 128, "sparse_topk_blocks": 16,
                                 "sparse_init_block": 0, "sparse_local_block": 1},
    )
    return model.to(device="cuda", dtype=torch.bfloat16)


@pytest.fixture
def recorded_selections(monkeypatch):
    """Copies of every selection the selectors return. Inside a capture the copy is captured too: its tensor then
    holds that layer's selection after every replay."""
    records = []
    select = sparse_attention.PageSelector.select

    def recording(self, layer_cache_pages, block_table, index_q, metadata):
        selection = select(self, layer_cache_pages, block_table, index_q, metadata)
        if metadata.step is None or metadata.step.selector is self:
            records.append(selection.clone())
        return selection

    monkeypatch.setattr(sparse_attention.PageSelector, "select", recording)
    return records


def decode(model, records, prompt, mask, steps, graphs, sparse_layers):
    """Greedy steps over a static cache: per step the logits and each sparse layer's selection."""
    cache = MiniMaxM3StaticCache(model.config, max_cache_len=prompt.shape[1] + steps)
    logits, selections = [], []
    with torch.no_grad():
        token = model(prompt, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            records.clear() if not graphs else None
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            output = model(token, attention_mask=mask, past_key_values=cache, decode_cuda_graphs=graphs)
            logits.append(output.logits[:, -1].float())
            selections.append([selection.clone() for selection in records[-sparse_layers:]])
            token = output.logits[:, -1:].argmax(-1)
    return torch.stack(logits), selections


def test_graphed_steps_give_the_eager_steps_pages_bitwise_and_logits_within_bf16_rounding(recorded_selections):
    """Every layer sparse (no dense attention, whose decode kernel differs): the step is the eager step's kernels on
    the same inputs, so the pages agree bit for bit, and the logits within bf16 rounding as the decode contract
    states. The compiled chains take inductor's deterministic mode (``minimax_m3.fusion``): without it this test
    failed in 3 of 6 pytest runs on the H200."""
    model = kernel_geometry_model([1, 1, 1])
    generator = torch.Generator(device="cuda").manual_seed(0)
    prompt = torch.randint(3, 97, (2, 2600), device="cuda", generator=generator)
    mask = torch.ones_like(prompt)
    mask[1, :300] = 0  # 21 and 18 pages of 128 under a top-16
    eager_logits, eager_pages = decode(model, recorded_selections, prompt, mask, 12, False, 3)
    recorded_selections.clear()
    graph_logits, graph_pages = decode(model, recorded_selections, prompt, mask, 12, True, 3)
    graph = model.model._decode_graphs[2]
    assert graph.graph is not None and graph.step.selector.indexer_backends() == {"cute"}  # its own plan
    for step, (ours, theirs) in enumerate(zip(graph_pages, eager_pages)):
        for layer, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(a, b), (step, layer)
    torch.testing.assert_close(graph_logits, eager_logits, atol=2e-2, rtol=1e-2)
    assert int(eager_pages[-1][0].max()) == 20  # 21 pages, of which 16 are kept: pages really dropped


def test_graphed_steps_with_a_dense_layer_agree_within_bf16_rounding_and_never_synchronise(recorded_selections):
    model = kernel_geometry_model([0, 1, 1])
    generator = torch.Generator(device="cuda").manual_seed(1)
    prompt = torch.randint(3, 97, (3, 2400), device="cuda", generator=generator)
    mask = torch.ones_like(prompt)
    mask[0, :250] = 0
    eager_logits, eager_pages = decode(model, recorded_selections, prompt, mask, 8, False, 2)
    recorded_selections.clear()
    graph_logits, graph_pages = decode(model, recorded_selections, prompt, mask, 8, True, 2)
    torch.testing.assert_close(graph_logits, eager_logits, atol=0.05, rtol=0.02)
    rows = same = 0
    for ours, theirs in zip(graph_pages, eager_pages):
        for a, b in zip(ours, theirs):
            rows += a.shape[0] * a.shape[1]
            same += int((a.sort(-1).values == b.sort(-1).values).all(-1).sum())
    print(f"page sets equal in {same} of {rows} (token, group) rows")
    assert same >= 0.9 * rows

    cache = MiniMaxM3StaticCache(model.config, max_cache_len=2500)
    with torch.no_grad():
        token = model(prompt, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
        token = model(token, past_key_values=cache, decode_cuda_graphs=True).logits[:, -1:].argmax(-1)  # captures
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(4):
                token = model(token, past_key_values=cache, decode_cuda_graphs=True).logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(token.float()).all()


def test_generate_on_cuda_replays_graphs_by_default_with_the_eager_tokens():
    model = kernel_geometry_model([1, 1, 1])
    generator = torch.Generator(device="cuda").manual_seed(2)
    prompt = torch.randint(3, 97, (2, 2200), device="cuda", generator=generator)
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    graphed = model.generate(prompt, **settings)
    assert model.model._decode_graphs[2].graph is not None
    eager = model.generate(prompt, decode_cuda_graphs=False, **settings)
    assert torch.equal(graphed, eager)


@pytest.mark.parametrize("batch, capacity", [(3, 5000), (1, 131072 // 16)])
def test_flash_decode_matches_an_fp32_softmax_over_each_sequences_keys(batch, capacity):
    """Random bf16 inputs, lengths 1, a chunk boundary (SPLIT_KEYS), one short of the capacity and the capacity itself;
    the cache rows past a sequence's length hold NaN, which must never be read."""
    from minimax_m3.decode_attention import SPLIT_KEYS, flash_decode

    generator = torch.Generator(device="cuda").manual_seed(3)
    heads, kv_heads, dim = 64, 4, 128
    q = torch.randn(batch, heads, dim, device="cuda", generator=generator).bfloat16()
    keys = torch.randn(batch, capacity, kv_heads, dim, device="cuda", generator=generator).bfloat16()
    values = torch.randn(batch, capacity, kv_heads, dim, device="cuda", generator=generator).bfloat16()
    lengths = [1, SPLIT_KEYS, capacity - 1, capacity][:batch] if batch > 1 else [capacity - 77]
    for b, length in enumerate(lengths):
        keys[b, length:] = float("nan")
        values[b, length:] = float("nan")
    kv_lengths = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    got = flash_decode(q, keys, values, kv_lengths, scale=dim ** -0.5)
    assert torch.isfinite(got.float()).all()
    for b, length in enumerate(lengths):
        query = q[b].float().view(kv_heads, heads // kv_heads, dim)
        logits = torch.einsum("grd,kgd->grk", query, keys[b, :length].float()) * dim ** -0.5
        expected = torch.einsum("grk,kgd->grd", torch.softmax(logits, -1), values[b, :length].float())
        torch.testing.assert_close(got[b].float(), expected.reshape(heads, dim), atol=2e-2, rtol=2e-2)


def test_a_chunk_over_a_cached_prefix_without_a_mask_never_synchronises():
    """Chunked prefill: without an attention mask the packed layout, the positions and the indexer's plan are built
    from host lengths and pinned copies, so a chunk (after one of its shape has warmed the kernels) never waits."""
    model = kernel_geometry_model([0, 1, 1])
    generator = torch.Generator(device="cuda").manual_seed(4)
    ids = torch.randint(3, 97, (1, 3072), device="cuda", generator=generator)
    cache = MiniMaxM3StaticCache(model.config, max_cache_len=3072)
    with torch.no_grad():
        model(ids[:, :2048], past_key_values=cache, logits_to_keep=1)
        model(ids[:, 2048:2560], past_key_values=cache, logits_to_keep=1)  # this chunk length's first run
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = model(ids[:, 2560:], past_key_values=cache, logits_to_keep=1).logits
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(logits.float()).all() and cache.lengths == [3072]  # chunked == one forward: on the CPU


def test_branches_fork_onto_the_side_stream_only_inside_a_capture_and_join_before_what_follows():
    from minimax_m3.streams import run_branches, side_stream

    device = torch.device("cuda")
    x = torch.randn(1 << 22, device=device)
    seen = []

    def side():
        seen.append(torch.cuda.current_stream(device))
        return torch.sort(x).values  # slow enough that an unjoined branch would be read unfinished; deterministic

    def main():
        return x.flip(0)

    eager_side, eager_main = run_branches(side, main, device)
    assert seen[-1] == torch.cuda.current_stream(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ordered, flipped = run_branches(side, main, device)
        joined = ordered * flipped
    assert seen[-1] == side_stream(device)
    for _ in range(3):
        x.normal_()
        graph.replay()
        assert torch.equal(joined, torch.sort(x).values * x.flip(0))


def test_a_captured_decode_step_forks_the_index_path_and_the_shared_expert(monkeypatch):
    """Each sparse layer's index path and each MoE layer's shared expert run on the side stream in the graph."""
    import minimax_m3.modeling_minimax_m3 as modeling
    from minimax_m3.streams import run_branches, side_stream

    forks = []

    def recording(side, main, device):
        def recorded_side():
            if torch.cuda.is_current_stream_capturing():
                forks.append(torch.cuda.current_stream(device) == side_stream(device))
            return side()
        return run_branches(recorded_side, main, device)

    monkeypatch.setattr(modeling, "run_branches", recording)
    model = kernel_geometry_model([0, 1, 1])  # MoE in layers 1 and 2
    prompt = torch.randint(3, 97, (2, 700), device="cuda")
    cache = MiniMaxM3StaticCache(model.config, max_cache_len=710)
    with torch.no_grad():
        token = model(prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
        model(token, past_key_values=cache, decode_cuda_graphs=True)
    assert model.model._decode_graphs[2].graph is not None
    assert forks == [True] * 4  # 2 index paths and 2 shared experts
