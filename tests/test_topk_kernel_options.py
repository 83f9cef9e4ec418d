"""CPU checks of the GPU top-k kernel's building blocks and options (the kernel itself runs in the gpu tests)."""

import inspect
import itertools

import pytest
import torch

from indexer import cute_backend
from indexer.topk import quantisation_keys

topk_kernel = pytest.importorskip("indexer.kernels.topk_select", reason="needs nvidia-cutlass-dsl")


def test_the_backend_options_are_the_kernel_constructor_options():
    parameters = inspect.signature(topk_kernel.TopkSelectKernel.__init__).parameters
    # programmatic_launch and warps_per_row are chosen per launch (PROGRAMMATIC_TOPK, TOPK_ROW_SPLIT_MAX_ROWS)
    assert set(cute_backend.TOPK_KERNEL_OPTIONS) == set(parameters) - {"self", "programmatic_launch", "warps_per_row"}
    for name, value in cute_backend.TOPK_KERNEL_OPTIONS.items():
        assert type(value) is type(parameters[name].default) or None in (value, parameters[name].default)


@pytest.mark.parametrize("options, name", [(dict(rest_batch=True), "rest_batch"), (dict(rest_batch=3), "rest_batch"),
                                           (dict(lane_list_length=8), "lane_list_length"),
                                           (dict(winners_in_shared=1), "winners_in_shared"),
                                           (dict(longest_rows_first="yes"), "longest_rows_first"),
                                           (dict(max_registers=8), "max_registers"),
                                           (dict(max_registers=40.0), "max_registers"),
                                           (dict(warps_per_row=2), "warps_per_row")])
def test_bad_options_are_rejected_by_name(options, name):
    with pytest.raises(ValueError, match=name):
        topk_kernel.TopkSelectKernel(**options)


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
