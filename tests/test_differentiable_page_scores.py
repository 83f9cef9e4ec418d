"""indexer.differentiable_page_scores: the torch backend's history-page scores, the local page over its causal keys,
-inf after it, and correct gradients through the page maximum."""

import pytest
import torch

from indexer import causal_page_counts, differentiable_page_scores
from indexer.torch_backend import HostMetadata, compute_page_scores


def backend_history_scores(q, k, *, prefix, page_size):
    """The torch backend's score buffer for one request whose queries are its last ``T`` tokens (positions
    ``prefix .. prefix + T - 1``) over the keys ``k``; entries the contract does not write stay NaN."""
    num_keys, head_dim = k.shape
    pages = -(-num_keys // page_size)
    k_pages = torch.zeros(pages * page_size, head_dim, dtype=k.dtype)
    k_pages[:num_keys] = k
    out = torch.full((q.shape[0] * q.shape[1], pages), float("nan"))
    compute_page_scores(q, k_pages.view(pages, page_size, head_dim), torch.arange(pages, dtype=torch.int32)[None],
                        HostMetadata((0, q.shape[0]), (num_keys,)), out, page_size=page_size)
    return out.view(q.shape[0], q.shape[1], pages)


def random_inputs(num_tokens, num_keys, *, heads, head_dim, dtype, seed, integers=False):
    generator = torch.Generator().manual_seed(seed)
    if integers:  # small integers: every product and sum is exact in fp32, so any summation order agrees
        draw = lambda *shape: torch.randint(-3, 4, shape, generator=generator).to(dtype)  # noqa: E731
    else:
        draw = lambda *shape: (torch.randn(*shape, generator=generator) * 0.5).to(dtype)  # noqa: E731
    return draw(num_tokens, heads, head_dim), draw(num_keys, head_dim)


@pytest.mark.parametrize("dtype, integers", [(torch.float8_e4m3fn, False), (torch.float32, True)])
@pytest.mark.parametrize("page_size, num_keys, num_tokens", [(128, 700, 700), (128, 700, 250), (16, 100, 37), (8, 64, 64)])
def test_history_pages_equal_the_torch_backend(dtype, integers, page_size, num_keys, num_tokens):
    q, k = random_inputs(num_tokens, num_keys, heads=2, head_dim=32, dtype=dtype, seed=num_keys + num_tokens,
                         integers=integers)
    prefix = num_keys - num_tokens
    positions = torch.arange(prefix, num_keys)
    # a small chunk makes the function cut the tokens into many chunks
    scores = differentiable_page_scores(q, k, positions, page_size=page_size, chunk_elements=4096)
    reference = backend_history_scores(q, k, prefix=prefix, page_size=page_size)
    assert scores.dtype == torch.float32 and scores.shape == reference.shape
    own_page = (positions // page_size)[:, None, None]
    page = torch.arange(reference.shape[2])[None, None, :]
    history = (page < own_page).expand_as(scores)
    assert history.any()
    assert torch.equal(scores[history], reference[history])  # bit for bit
    assert torch.isnan(reference[~history]).all()  # the backend writes exactly the history pages


def test_local_page_over_causal_keys_and_future_pages_minus_infinity():
    q, k = random_inputs(40, 40, heads=3, head_dim=8, dtype=torch.float64, seed=1)
    positions = torch.arange(40)
    scores = differentiable_page_scores(q, k, positions, page_size=16)
    products = torch.einsum("thd,sd->ths", q, k)
    for t in range(40):
        own = t // 16
        for page in range(scores.shape[2]):
            if page > own:
                assert torch.all(scores[t, :, page] == float("-inf"))
            else:
                last = min(t, page * 16 + 15)  # the local page stops at the token itself
                expected = products[t, :, page * 16 : last + 1].amax(-1)
                assert torch.equal(scores[t, :, page], expected)
    assert torch.equal(causal_page_counts(positions, 16), torch.isfinite(scores[:, 0]).sum(-1))


def test_positions_may_be_any_subset_in_any_order():
    q, k = random_inputs(6, 50, heads=2, head_dim=4, dtype=torch.float64, seed=2)
    positions = torch.tensor([49, 3, 17, 16, 15, 0])
    whole = differentiable_page_scores(q, k, positions, page_size=16)
    for index in range(6):
        alone = differentiable_page_scores(q[index : index + 1], k, positions[index : index + 1], page_size=16)
        assert torch.equal(alone[0], whole[index])


def test_gradients_through_the_page_maximum():
    q, k = random_inputs(5, 9, heads=2, head_dim=3, dtype=torch.float64, seed=3)
    q.requires_grad_(True)
    k.requires_grad_(True)
    positions = torch.tensor([8, 2, 5, 3, 7])

    def finite_scores(q, k):
        scores = differentiable_page_scores(q, k, positions, page_size=3, chunk_elements=20)
        return torch.where(torch.isfinite(scores), scores, 0.0)

    assert torch.autograd.gradcheck(finite_scores, (q, k))


def test_graph_keeps_no_product_block():
    """Only the winning keys' indices are kept for the backward pass, not the [T, H, S] products."""
    q, k = random_inputs(512, 512, heads=2, head_dim=16, dtype=torch.float32, seed=4)
    q.requires_grad_(True)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        differentiable_page_scores(q, k, torch.arange(512), page_size=128, chunk_elements=1 << 16)
    assert max(saved) < 512 * 2 * 512  # at most a chunk's inputs or the [T, H, pages] indices


def test_errors_name_the_argument():
    q, k = random_inputs(4, 8, heads=2, head_dim=4, dtype=torch.float32, seed=5)
    positions = torch.arange(4, 8)
    with pytest.raises(TypeError, match="q must have dtype"):
        differentiable_page_scores(q.long(), k, positions, page_size=4)
    with pytest.raises(TypeError, match="k must have dtype"):
        differentiable_page_scores(q, k.double(), positions, page_size=4)
    with pytest.raises(ValueError, match=r"k must be \[S, 4\]"):
        differentiable_page_scores(q, k[:, :3], positions, page_size=4)
    with pytest.raises(ValueError, match="positions must lie in"):
        differentiable_page_scores(q, k, positions + 1, page_size=4)
    with pytest.raises(ValueError, match="positions must have shape"):
        differentiable_page_scores(q, k, positions[:3], page_size=4)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        differentiable_page_scores(q, k, positions, page_size=0)
