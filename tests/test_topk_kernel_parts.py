"""CPU checks of the GPU top-k kernel's building blocks (the kernel itself runs in the gpu tests)."""

import itertools

import pytest
import torch

from indexer.topk import quantisation_keys

topk_kernel = pytest.importorskip("indexer.kernels.topk_select", reason="needs nvidia-cutlass-dsl")


def test_a_bad_row_split_is_rejected_by_name():
    with pytest.raises(ValueError, match="warps_per_row"):
        topk_kernel.TopkSelectKernel(warps_per_row=2)


@pytest.mark.parametrize("size", [8, 16])
def test_the_odd_even_merge_network_sorts_every_input(size):
    """0-1 principle: a compare-exchange network that sorts every 0/1 input sorts every input."""
    network = topk_kernel.odd_even_merge_sort_network(size)
    for bits in itertools.product((0, 1), repeat=size):
        keys = list(bits)
        for i, j in network:
            keys[i], keys[j] = max(keys[i], keys[j]), min(keys[i], keys[j])
        assert keys == sorted(bits, reverse=True)


def test_the_four_key_network_sorts_every_order():
    for order in itertools.permutations(range(4)):
        keys = list(order)
        for i, j in topk_kernel.sort4_descending_network():
            keys[i], keys[j] = max(keys[i], keys[j]), min(keys[i], keys[j])
        assert keys == [3, 2, 1, 0]


@pytest.mark.parametrize("length", range(1, 18))
def test_the_trace_time_trees_combine_every_value_once(length):
    from indexer.kernels.trees import pairwise_tree, ternary_tree

    values = torch.randn(length, generator=torch.Generator().manual_seed(length)).tolist()
    for tree in (pairwise_tree, ternary_tree):
        assert tree(values, min) == min(values) and tree(values, max) == max(values)
        assert tree([[value] for value in values], lambda a, b: a + b) == values  # each once, in order


def test_either_signed_zero_as_the_row_minimum_quantises_alike():
    """The warp min/max may return -0.0 or +0.0 for a row whose minimum is zero (shuffles and the integer redux break
    the tie differently): the contract's keys are the same either way."""
    generator = torch.Generator().manual_seed(5)
    magnitude = 10.0 ** torch.randint(-30, 30, (1000, 1), generator=generator)
    rows = torch.cat([torch.rand(1000, 40, generator=generator) * magnitude, torch.zeros(4, 40)])
    negative_zero, positive_zero = rows.clone(), rows.clone()
    negative_zero[:, 0], positive_zero[:, 0] = -0.0, 0.0
    history = torch.full((rows.shape[0],), 40)
    assert torch.equal(quantisation_keys(negative_zero, history), quantisation_keys(positive_zero, history))
