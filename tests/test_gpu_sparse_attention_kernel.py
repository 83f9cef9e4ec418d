"""The SM90 CuTe sparse-attention kernel against the exact reference (run on the H200)."""

import pytest
import torch

from minimax_m3.bench_prefill import clustered_selection
from minimax_m3.sparse_attention import ForwardMetadata, resolve_auto_implementation, sparse_attention_reference
from minimax_m3.sparse_attention_cute import sparse_attention_cute

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs SM90"),
]

PAGE, TOPK, HEADS, KV_HEADS, DIM = 128, 16, 64, 4, 128


def _contract_selection(positions, num_groups, generator):
    """Per (token, group): the local page plus up to 15 distinct random history pages, -1 padded (the contract's
    shape, with tokens of few pages selecting all of them)."""
    rows = []
    for position in positions.tolist():
        local = position // PAGE
        per_group = []
        for _ in range(num_groups):
            history = torch.randperm(local, generator=generator)[: TOPK - 1].tolist() if local else []
            pages = history + [local]
            per_group.append(pages + [-1] * (TOPK - len(pages)))
        rows.append(per_group)
    return torch.tensor(rows, dtype=torch.int32)


def _batch(query_lengths, kv_lengths, generator, capacity):
    batch_index, positions, starts = [], [], []
    for sequence, (count, kv_length) in enumerate(zip(query_lengths, kv_lengths)):
        starts.append(len(positions))
        positions += range(kv_length - count, kv_length)
        batch_index += [sequence] * count
    metadata = ForwardMetadata(torch.tensor(batch_index).cuda(), torch.tensor(positions).cuda(), list(query_lengths),
                               list(kv_lengths), starts)
    total = len(positions)
    q = (torch.randn(total, HEADS, DIM, generator=generator) * 2).to(torch.bfloat16).cuda()
    keys = torch.randn(len(query_lengths), capacity, KV_HEADS, DIM, generator=generator).to(torch.bfloat16).cuda()
    values = torch.randn(len(query_lengths), capacity, KV_HEADS, DIM, generator=generator).to(torch.bfloat16).cuda()
    return q, keys, values, metadata


def _check(q, keys, values, selection, metadata):
    scale = DIM ** -0.5
    poisoned = torch.full_like(q, float("nan"))
    got = sparse_attention_cute(q, keys, values, selection, metadata, scale=scale, page_size=PAGE, out=poisoned)
    expected = sparse_attention_reference(q, keys, values, selection, metadata, scale=scale, page_size=PAGE)
    assert torch.isfinite(got).all(), "rows left unwritten or non-finite"
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= 2e-2, f"max |cute - reference| = {error}"
    return error


def test_varlen_batch_with_cached_prefixes_matches_the_reference():
    """Three sequences: a fresh prefill, a chunk over a cached prefix, a short chunk deep in a context (query
    tiles span sequence boundaries; token counts are not multiples of the 8-token tile)."""
    generator = torch.Generator().manual_seed(0)
    query_lengths, kv_lengths = [1003, 301, 37], [1003, 2600, 5000]
    q, keys, values, metadata = _batch(query_lengths, kv_lengths, generator, capacity=5120)
    selection = _contract_selection(metadata.positions.cpu(), KV_HEADS, generator).cuda()
    _check(q, keys, values, selection, metadata)


def test_clustered_selection_matches_the_reference():
    generator = torch.Generator().manual_seed(1)
    q, keys, values, metadata = _batch([4096], [4096], generator, capacity=4096)
    selection = clustered_selection(4096, KV_HEADS, TOPK, PAGE, "cuda")
    _check(q, keys, values, selection, metadata)


def test_repeat_runs_are_bitwise_identical_and_auto_picks_the_kernel():
    generator = torch.Generator().manual_seed(2)
    q, keys, values, metadata = _batch([517], [3000], generator, capacity=3072)
    selection = _contract_selection(metadata.positions.cpu(), KV_HEADS, generator).cuda()
    first = sparse_attention_cute(q, keys, values, selection, metadata, scale=DIM ** -0.5, page_size=PAGE)
    second = sparse_attention_cute(q, keys, values, selection, metadata, scale=DIM ** -0.5, page_size=PAGE)
    assert torch.equal(first, second)
    assert resolve_auto_implementation(q, keys, PAGE) == "cute"
    assert resolve_auto_implementation(q.float(), keys.float(), PAGE) == "flex"
    trainable = q.detach().clone().requires_grad_()
    assert resolve_auto_implementation(trainable, keys, PAGE) == "flex"  # the kernel has no backward
    with pytest.raises(ValueError, match="forward-only"):
        sparse_attention_cute(trainable, keys, values, selection, metadata, scale=DIM ** -0.5, page_size=PAGE)


def _guarded(like: torch.Tensor, guard: int = 4096):
    """A NaN buffer with ``like``'s shape in its middle and NaN guard regions of ``guard`` elements either side."""
    storage = torch.full((guard + like.numel() + guard,), float("nan"), dtype=like.dtype, device=like.device)
    return storage, storage[guard : guard + like.numel()].view(like.shape)


@pytest.mark.parametrize("query_lengths, kv_lengths", [
    ([1] * 16, [1, 127, 128, 129, 1000, 2047, 2048, 4000, 8191, 8192, 300, 5555, 6000, 7000, 7777, 64]),  # decode, B=16
    ([1], [8192]),  # decode, batch 1
    ([4, 2, 16], [4000, 2, 8192]),  # verify steps: a tile's tokens share a sequence (and pages)
])
def test_decode_kernel_matches_the_reference_on_random_selections(query_lengths, kv_lengths):
    """The split-KV decode variant (forwards of at most 16 new tokens per sequence): random contract selections
    (the local page and up to 15 random earlier ones, -1 padded), out written into a NaN buffer whose guard regions
    must stay NaN."""
    from minimax_m3.sparse_attention_cute import DECODE_MAX_QUERY_LENGTH

    assert max(query_lengths) <= DECODE_MAX_QUERY_LENGTH
    generator = torch.Generator().manual_seed(4)
    q, keys, values, metadata = _batch(query_lengths, kv_lengths, generator, capacity=8192)
    selection = _contract_selection(metadata.positions.cpu(), KV_HEADS, generator).cuda()
    storage, out = _guarded(q)
    got = sparse_attention_cute(q, keys, values, selection, metadata, scale=DIM ** -0.5, page_size=PAGE, out=out)
    assert got.data_ptr() == out.data_ptr()
    expected = sparse_attention_reference(q, keys, values, selection, metadata, scale=DIM ** -0.5, page_size=PAGE)
    assert torch.isfinite(out.float()).all(), "rows left unwritten or non-finite"
    assert torch.isnan(storage[:4096].float()).all() and torch.isnan(storage[-4096:].float()).all(), "guard written"
    error = (out.float() - expected.float()).abs().max().item()
    assert error <= 2e-2, f"max |cute decode - reference| = {error}"


def test_decode_kernel_merges_in_the_last_split_and_leaves_its_counters_at_zero():
    """The last split CTA of each (token, group) merges the splits: over calls with 1 to 16 tokens (16 to 1 splits
    per token) every output equals the reference, a token whose pages are all skipped gets zeros, and the arrival
    counters are zero after each call (a counter left behind would skip the next call's merge)."""
    from minimax_m3.sparse_attention_cute import decode_arrival_counters, decode_splits

    generator = torch.Generator().manual_seed(6)
    for tokens in (1, 3, 4, 16, 1, 4):
        q, keys, values, metadata = _batch([1] * tokens, [8192 - 37 * t for t in range(tokens)], generator,
                                           capacity=8192)
        selection = _contract_selection(metadata.positions.cpu(), KV_HEADS, generator).cuda()
        if tokens > 1:
            selection[1] = -1  # the second token reads nothing
        storage, out = _guarded(q)
        sparse_attention_cute(q, keys, values, selection, metadata, scale=DIM ** -0.5, page_size=PAGE, out=out)
        expected = sparse_attention_reference(q, keys, values, selection, metadata, scale=DIM ** -0.5, page_size=PAGE)
        assert torch.isfinite(out.float()).all(), f"{tokens} tokens: rows left unmerged"
        assert torch.isnan(storage[:4096].float()).all() and torch.isnan(storage[-4096:].float()).all()
        read = torch.arange(tokens, device=q.device) != 1  # the reference's softmax over no key is NaN
        error = (out[read].float() - expected[read].float()).abs().max().item()
        assert error <= 2e-2, f"{tokens} tokens ({decode_splits(tokens, KV_HEADS, TOPK, 132)} splits): error {error}"
        if tokens > 1:
            assert torch.equal(out[1], torch.zeros_like(out[1]))
        counters = decode_arrival_counters(q.device, tokens * KV_HEADS)
        assert torch.equal(counters, torch.zeros_like(counters))


def test_decode_kernel_skips_page_ids_beyond_the_sequence():
    """Selection entries past the cache's pages of a sequence (or -1) read nothing: the result equals the
    selection without them, and no other sequence's page is read."""
    generator = torch.Generator().manual_seed(5)
    q, keys, values, metadata = _batch([1, 1], [3000, 8000], generator, capacity=8192)
    selection = _contract_selection(metadata.positions.cpu(), KV_HEADS, generator).cuda()
    keys[0, 3000:] = float("nan")  # the first sequence's slots past its length
    without = selection.clone()
    without[0, :, :2] = -1  # two history pages of the first sequence dropped
    clean = sparse_attention_cute(q, keys, values, without, metadata, scale=DIM ** -0.5, page_size=PAGE)
    assert torch.isfinite(clean.float()).all()
    poisoned = selection.clone()
    poisoned[0, :, 0] = 64  # one past the sequence's 64 pages: the next sequence's first page in the cache
    poisoned[0, :, 1] = 1 << 20
    got = sparse_attention_cute(q, keys, values, poisoned, metadata, scale=DIM ** -0.5, page_size=PAGE)
    assert torch.equal(got, clean)
