"""A damaged checkpoint raises before any weight is read, naming the shard and the tensor (``loading.check_shards``):
a truncated shard, a tensor of another shape, a tensor the index lists but the shard lacks, FP8 weights without
scales or with scales of another shape, and an E8M0 scale byte 0xFF (NaN)."""

import json
import os
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from minimax_m3 import MiniMaxM3ForCausalLM
from minimax_m3 import synthetic_checkpoint as synthetic
from test_synthetic_checkpoint import TINY

Q_PROJ = "language_model.model.layers.2.self_attn.q_proj.weight"
O_PROJ = "language_model.model.layers.2.self_attn.o_proj.weight"
NORM = "language_model.model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny MXFP8 checkpoint in the release's layout, in several shards."""
    return synthetic.write_synthetic_checkpoint(tmp_path_factory.mktemp("pristine") / "slice",
                                                synthetic.released_slice_config(1, 2, **TINY), shard_bytes=20_000,
                                                device="cpu")


@pytest.fixture
def checkpoint(pristine, tmp_path):
    """A copy of ``pristine`` to damage, and the shard of each tensor."""
    path = shutil.copytree(pristine, tmp_path / "slice")
    return path, json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def data_offsets(file, key):
    """Where tensor ``key``'s data lies in safetensors ``file``, from its header (the safetensors format)."""
    with open(file, "rb") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        begin, end = json.loads(handle.read(length))[key]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def rewrite(file, change):
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def raises_naming(path, file, key, error=ValueError, detail=""):
    """``from_pretrained`` raises ``error`` whose message starts with the shard's path and names ``key``."""
    with pytest.raises(error) as raised:
        MiniMaxM3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert type(raised.value) is error
    message = str(raised.value)
    assert message.startswith(f"{path / file}: ") and key in message and re.search(detail, message), message
    return message


def test_the_undamaged_checkpoint_loads(checkpoint):
    path, _ = checkpoint
    model = MiniMaxM3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_a_shard_cut_short_names_the_first_tensor_it_cuts(checkpoint):
    path, shards = checkpoint
    begin, _ = data_offsets(path / shards[Q_PROJ], Q_PROJ)
    os.truncate(path / shards[Q_PROJ], begin + 100)
    raises_naming(path, shards[Q_PROJ], f"tensor {Q_PROJ}: ", detail="the shard is truncated, re-download it")


def test_a_shard_cut_inside_its_header_names_a_tensor_the_index_puts_in_it(checkpoint):
    path, shards = checkpoint
    os.truncate(path / shards[Q_PROJ], 20)
    in_shard = sorted(key for key, file in shards.items() if file == shards[Q_PROJ])
    raises_naming(path, shards[Q_PROJ], in_shard[0], detail="none of its tensors .* can be read; the shard is truncated")


def test_bytes_after_the_last_tensor_name_the_shard(checkpoint):
    path, shards = checkpoint
    with open(path / shards[Q_PROJ], "ab") as handle:
        handle.write(b"\0" * 16)
    raises_naming(path, shards[Q_PROJ], "language_model.", detail="16 bytes follow the data of its last tensor")


@pytest.mark.parametrize("key", [Q_PROJ, NORM])
def test_a_tensor_of_another_shape_names_it_and_both_shapes(checkpoint, key):
    path, shards = checkpoint

    def halve(tensors):
        for name in (key, key + "_scale_inv"):
            if name in tensors:
                tensors[name] = tensors[name][: tensors[name].shape[0] // 2].contiguous()

    rewrite(path / shards[key], halve)
    expected = [128, 64] if key == Q_PROJ else [64]
    stored = [64, 64] if key == Q_PROJ else [32]
    raises_naming(path, shards[key], f"tensor {key}: ", detail=re.escape(f"shape {stored} where the checkpoint's "
                                                                         f"config.json makes it {expected}"))


def test_scales_of_another_shape_name_the_scales(checkpoint):
    path, shards = checkpoint
    scales = Q_PROJ + "_scale_inv"
    rewrite(path / shards[scales], lambda tensors: tensors.update({scales: tensors[scales][:64].contiguous()}))
    raises_naming(path, shards[scales], f"tensor {scales}: ", detail=re.escape("in 1x32 blocks needs [128, 2]"))


def test_a_tensor_the_index_lists_but_the_shard_lacks_names_both(checkpoint):
    path, shards = checkpoint
    rewrite(path / shards[O_PROJ], lambda tensors: [tensors.pop(O_PROJ), tensors.pop(O_PROJ + "_scale_inv")])
    raises_naming(path, shards[O_PROJ], f"tensor {O_PROJ}: ", detail="the checkpoint is incomplete")


def test_an_fp8_weight_without_its_scales_names_it(checkpoint):
    path, shards = checkpoint
    scales = Q_PROJ + "_scale_inv"
    rewrite(path / shards[scales], lambda tensors: tensors.pop(scales))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"][scales]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    raises_naming(path, shards[Q_PROJ], f"tensor {Q_PROJ}: ", detail="without its .*_scale_inv")


def test_e8m0_scale_bytes_0xff_name_the_scales_and_count_them(checkpoint):
    path, shards = checkpoint
    scales = Q_PROJ + "_scale_inv"

    def poison(tensors):
        tensors[scales][0, 0] = tensors[scales][5, 1] = tensors[scales][127, 1] = 0xFF

    rewrite(path / shards[scales], poison)
    raises_naming(path, shards[scales], f"tensor {scales}: ", detail="3 of its 256 E8M0 scale bytes are 0xFF")


def test_a_tensor_in_two_shards_names_both(checkpoint):
    path, shards = checkpoint
    other = next(file for file in sorted(set(shards.values())) if file != shards[NORM])
    norm = load_file(str(path / shards[NORM]))[NORM]
    rewrite(path / other, lambda tensors: tensors.update({NORM: norm.clone()}))
    with pytest.raises(ValueError, match=f"tensor {re.escape(NORM)} is in both {shards[NORM]} and {other}"):
        MiniMaxM3ForCausalLM.from_pretrained(path)
