"""Projections of one input packed into one weight storage (``minimax_m3.packed_projections``)."""

import copy
import logging

import pytest
import torch
from torch import nn

from minimax_m3 import MiniMaxM3ForCausalLM
from minimax_m3.packed_projections import ProjectionGroup, pack
from test_minimax_m3 import tiny_model

SPARSE_GROUP = ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj")


def storage_rows(module, names):
    """Each named weight's first element's offset, in rows of the first weight, from the first weight's start."""
    first = getattr(module, names[0]).weight
    return [(getattr(module, name).weight.data_ptr() - first.data_ptr()) // (first.shape[1] * first.element_size())
            for name in names]


def expected_rows(module, names):
    rows, start = [], 0
    for name in names:
        rows.append(start)
        start += getattr(module, name).weight.shape[0]
    return rows


def assert_packed(model):
    layers = model.model.layers
    dense, sparse = layers[0], layers[1]
    assert storage_rows(dense.self_attn, ("q_proj", "k_proj", "v_proj")) == expected_rows(dense.self_attn, ("q_proj", "k_proj", "v_proj"))
    assert storage_rows(sparse.self_attn, SPARSE_GROUP) == expected_rows(sparse.self_attn, SPARSE_GROUP)
    for mlp in (dense.mlp, sparse.block_sparse_moe.shared_experts):
        assert storage_rows(mlp, ("gate_proj", "up_proj")) == expected_rows(mlp, ("gate_proj", "up_proj"))


def test_a_built_model_holds_each_group_in_one_storage_under_the_checkpoint_names():
    model = tiny_model()
    assert_packed(model)
    attention = model.model.layers[1].self_attn
    assert attention.q_proj.weight.untyped_storage().data_ptr() == attention.index_k_proj.weight.untyped_storage().data_ptr()
    names = set(model.state_dict())
    for name in SPARSE_GROUP:
        assert f"model.layers.1.self_attn.{name}.weight" in names
    assert not any("input_projections" in name for name in names)


def test_packed_projections_equal_the_modules_own():
    model = tiny_model()
    attention = model.model.layers[1].self_attn
    attention.double()
    attention.input_projections.pack(attention)
    x = torch.randn(7, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        packed = attention.input_projections(attention, x)
        for name, value in zip(SPARSE_GROUP, packed):
            torch.testing.assert_close(value, getattr(attention, name)(x), rtol=1e-12, atol=1e-12)
        index = attention.input_projections(attention, x, ("index_q_proj", "index_k_proj"))
        torch.testing.assert_close(index[1], attention.index_k_proj(x), rtol=1e-12, atol=1e-12)


def test_casting_the_model_packs_it_again_and_keeps_every_weight():
    model = tiny_model()
    expected = {name: value.bfloat16() for name, value in model.state_dict().items()}
    model.bfloat16()
    assert_packed(model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    model.float()
    assert_packed(model)
    assert model.model.layers[1].self_attn.q_proj.weight.dtype == torch.float32


def test_save_and_load_round_trip_the_values_and_the_loaded_model_is_packed(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "saved")
    loaded = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "saved")
    assert_packed(loaded)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids = torch.randint(3, 97, (1, 17))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_training_gives_each_projection_its_own_gradient():
    packed = tiny_model()
    separate = copy.deepcopy(packed)
    for module in separate.modules():  # give every weight its own storage
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(module.weight.detach().clone())
    ids = torch.randint(3, 97, (2, 13))
    for model in (packed, separate):
        model.train()
        model(ids, labels=ids).loss.backward()
    attention = packed.model.layers[1].self_attn
    assert all(getattr(attention, name).weight.grad is not None for name in ("q_proj", "k_proj", "v_proj"))
    for (name, a), (_, b) in zip(packed.named_parameters(), separate.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name  # the index projections train on their own loss
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_hooked_or_replaced_member_is_projected_by_its_module(caplog):
    model = tiny_model()
    attention = model.model.layers[1].self_attn
    x = torch.randn(5, model.config.hidden_size)
    seen = []
    handle = attention.k_proj.register_forward_hook(lambda module, inputs, output: seen.append(output))
    with torch.no_grad():
        _, k, _ = attention.input_projections(attention, x, ("q_proj", "k_proj", "v_proj"))
    handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], k)

    attention.v_proj.weight = nn.Parameter(torch.randn_like(attention.v_proj.weight))
    with caplog.at_level(logging.INFO, logger="minimax_m3.packed_projections"), torch.no_grad():
        _, _, v = attention.input_projections(attention, x, ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(v, attention.v_proj(x))
    assert "replaced after packing" in caplog.text
    model.pack_projections()
    assert_packed(model)


def test_groups_that_cannot_share_a_storage_are_left_alone_with_the_reason():
    with_bias = [nn.Linear(8, 4), nn.Linear(8, 4)]
    pointers = [linear.weight.data_ptr() for linear in with_bias]
    assert "bias" in pack(with_bias)
    assert [linear.weight.data_ptr() for linear in with_bias] == pointers
    mixed = [nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False).double()]
    assert "dtype" in pack(mixed)
    widths = [nn.Linear(8, 4, bias=False), nn.Linear(6, 4, bias=False)]
    assert "width" in pack(widths)

    class Adapted(nn.Linear):
        pass

    assert "plain nn.Linear" in pack([nn.Linear(8, 4, bias=False), Adapted(8, 4, bias=False)])


def test_a_group_projects_module_by_module_where_its_weights_are_not_packed():
    owner = nn.Module()
    owner.a, owner.b = nn.Linear(8, 4, bias=False), nn.Linear(8, 3, bias=False)
    group = ProjectionGroup(("a", "b"))
    x = torch.randn(2, 8)
    with torch.no_grad():
        unpacked = group(owner, x)
        assert group.pack(owner) is None
        packed = group(owner, x)
    for u, p, module in zip(unpacked, packed, (owner.a, owner.b)):
        assert torch.equal(u, module(x))
        torch.testing.assert_close(p, module(x))


def test_an_unknown_member_name_fails_by_name():
    owner = nn.Module()
    owner.a = nn.Linear(8, 4, bias=False)
    with pytest.raises(AttributeError, match="a_missing_member"):
        ProjectionGroup(("a", "a_missing_member"))(owner, torch.randn(1, 8))
