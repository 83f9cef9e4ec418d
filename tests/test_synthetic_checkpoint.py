"""``minimax_m3.synthetic_checkpoint``: the MXFP8 release's layout at a tiny size round-trips through
``from_pretrained``; the release-size plan has the release's names, shapes and dtypes."""

import json

import pytest
import torch
from safetensors import safe_open

from minimax_m3 import MiniMaxM3ForCausalLM
from minimax_m3 import synthetic_checkpoint as synthetic
from minimax_m3.conversion import checkpoint_state_dict
from test_minimax_m3_loading import dequantize_mxfp8

TINY = dict(vocab_size=97, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, rotary_dim=16, index_dtype="float32", bos_token_id=1, eos_token_id=2,
            pad_token_id=0,
            sparse_attention_config=dict(sparse_num_index_heads=2, sparse_index_dim=32, sparse_block_size=8,
                                         sparse_topk_blocks=3))


def tiny_slice():
    return synthetic.released_slice_config(1, 2, **TINY)


def stored(path):
    """Every tensor of the checkpoint at ``path`` by name, read through its index."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as handle:
            for key in handle.keys():
                assert index["weight_map"][key] == file
                tensors[key] = handle.get_tensor(key)
    assert set(tensors) == set(index["weight_map"])
    return index, tensors


def test_a_tiny_slice_round_trips_through_from_pretrained_as_the_written_values(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "BLOCK_ELEMENTS", 512)  # several row blocks per tensor: the offsets are exercised
    path = synthetic.write_synthetic_checkpoint(tmp_path / "slice", tiny_slice(), seed=3, shard_bytes=20_000,
                                                device="cpu")
    index, tensors = stored(path)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "minimax_m3_vl" and config["text_config"]["max_position_embeddings"] == 1 << 20
    assert config["text_config"]["moe_layer_freq"] == [0, 1, 1]
    assert config["text_config"]["sparse_attention_config"]["sparse_attention_freq"] == [0, 1, 1]
    quantization = config["quantization_config"]
    assert quantization["quant_method"] == "mxfp8" and quantization["weight_block_size"] == [1, 32]
    assert "model.layers.1.block_sparse_moe.gate" in quantization["ignored_layers"]
    assert len(set(index["weight_map"].values())) > 2 and all(key.startswith("language_model.") for key in tensors)
    assert not list(tmp_path.glob(".slice.*"))  # no staging directory left behind

    q_proj = "language_model.model.layers.2.self_attn.q_proj.weight"
    assert tensors[q_proj].dtype == torch.float8_e4m3fn
    assert tensors[q_proj + "_scale_inv"].dtype == torch.uint8 and tensors[q_proj + "_scale_inv"].shape == (128, 2)
    assert tensors["language_model.model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32
    assert tensors["language_model.model.embed_tokens.weight"].dtype == torch.bfloat16
    assert "language_model.lm_head.weight" in tensors  # untied

    loaded = MiniMaxM3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert loaded.config.max_position_embeddings == 1 << 20 and loaded.config.num_hidden_layers == 3
    checkpoint = checkpoint_state_dict(loaded)  # per-expert w1 / w3 / w2 again
    assert {"language_model." + name for name in checkpoint} == {k for k in tensors if not k.endswith("_scale_inv")}
    for name, value in checkpoint.items():
        written = tensors["language_model." + name]
        if written.dtype == torch.float8_e4m3fn:
            expected = dequantize_mxfp8(written, tensors["language_model." + name + "_scale_inv"])
            assert torch.equal(value.float(), expected), name  # e4m3 times a power of two is exact in bf16
        else:
            assert torch.equal(value.to(written.dtype), written), name
    logits = loaded(torch.randint(3, 97, (1, 40))).logits
    assert torch.isfinite(logits).all()


def test_a_seed_always_gives_the_same_checkpoint(tmp_path):
    config = tiny_slice()
    first = stored(synthetic.write_synthetic_checkpoint(tmp_path / "a", config, seed=1, device="cpu"))[1]
    again = stored(synthetic.write_synthetic_checkpoint(tmp_path / "b", config, seed=1, device="cpu"))[1]
    other = stored(synthetic.write_synthetic_checkpoint(tmp_path / "c", config, seed=2, device="cpu"))[1]
    assert all(torch.equal(first[k].view(torch.uint8), again[k].view(torch.uint8)) for k in first)
    assert not torch.equal(first["language_model.model.embed_tokens.weight"], other["language_model.model.embed_tokens.weight"])


def test_a_failed_write_leaves_the_previous_output_and_no_partial_directory(tmp_path, monkeypatch):
    path = synthetic.write_synthetic_checkpoint(tmp_path / "slice", tiny_slice(), seed=0, device="cpu")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(FileExistsError, match="overwrite"):
        synthetic.write_synthetic_checkpoint(path, tiny_slice(), device="cpu")
    calls = []

    def fail_on_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("No space left on device")
        return original(*args)

    original = synthetic._write_tensor
    monkeypatch.setattr(synthetic, "_write_tensor", fail_on_the_third)
    with pytest.raises(OSError, match="No space"):
        synthetic.write_synthetic_checkpoint(path, tiny_slice(), seed=5, device="cpu", overwrite=True)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slice"]


def test_the_release_slice_has_the_release_names_shapes_and_dtypes():
    specs = {spec.name: spec for spec in synthetic.checkpoint_tensors(synthetic.released_slice_config())}
    layer = "language_model.model.layers."
    assert len([n for n in specs if ".experts." in n]) == 2 * 128 * 3
    expected = {
        "language_model.model.embed_tokens.weight": ((200064, 6144), torch.bfloat16),
        "language_model.lm_head.weight": ((200064, 6144), torch.bfloat16),
        layer + "0.self_attn.q_proj.weight": ((8192, 6144), torch.float8_e4m3fn),
        layer + "0.self_attn.o_proj.weight": ((6144, 8192), torch.float8_e4m3fn),
        layer + "2.mlp.down_proj.weight": ((6144, 12288), torch.float8_e4m3fn),
        layer + "3.self_attn.index_q_proj.weight": ((512, 6144), torch.float8_e4m3fn),
        layer + "3.self_attn.index_k_proj.weight": ((128, 6144), torch.float8_e4m3fn),
        layer + "4.block_sparse_moe.gate.weight": ((128, 6144), torch.float32),
        layer + "4.block_sparse_moe.e_score_correction_bias": ((128,), torch.float32),
        layer + "4.block_sparse_moe.experts.127.w2.weight": ((6144, 3072), torch.float8_e4m3fn),
        layer + "4.block_sparse_moe.shared_experts.gate_proj.weight": ((3072, 6144), torch.float8_e4m3fn),
    }
    for name, (shape, dtype) in expected.items():
        assert (specs[name].shape, specs[name].dtype) == (shape, dtype), name
    assert specs[layer + "0.mlp.down_proj.weight"].scale_shape == (6144, 384)
    assert not any("index" in n for n in specs if n.startswith(layer + "2."))  # dense layers have no indexer
    total = sum(spec.stored_bytes for spec in specs.values())
    assert total == sum(spec.shape[0] * spec.shape[1] * 33 // 32 if spec.quantized
                        else torch.zeros(spec.shape, dtype=spec.dtype, device="meta").nbytes for spec in specs.values())
    assert 20e9 < total < 22e9


def test_the_command_line_refuses_bad_arguments_before_writing(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    for argv, message in ((["--dense-layers", "-1"], "integer >= 0"), (["--shard-size", "lots"], "size like"),
                          (["--dense-layers", "0", "--sparse-layers", "0"], ">= 1"), ([], "exists")):
        target = str(tmp_path / ("taken" if not argv else "new"))
        with pytest.raises(SystemExit):
            synthetic.main([target, *argv])
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_loading_is_measured_with_its_host_memory(tmp_path, capsys):
    from minimax_m3 import bench_loading

    path = synthetic.write_synthetic_checkpoint(tmp_path / "slice", tiny_slice(), device="cpu")
    bench_loading.main([str(path), "--device", "cpu"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert out.startswith("loaded 3 layers") and result["layers"] == 3 and result["load_seconds"] > 0
    assert result["largest_shard_bytes"] == max(p.stat().st_size for p in path.glob("*.safetensors"))
    if result["host_peak_bytes"] is not None:  # Linux
        assert result["host_peak_bytes"] >= result["host_resident_after_bytes"] > 0
        assert result["host_anonymous_peak_bytes"] >= result["host_anonymous_before_bytes"] > 0
        assert result["host_file_backed_peak_bytes"] > 0
    with pytest.raises(SystemExit):
        bench_loading.main([str(tmp_path), "--device", "cpu"])
    assert "no config.json" in capsys.readouterr().err


def test_the_host_memory_sampler_keeps_a_peak_that_only_its_thread_saw(monkeypatch):
    # The kernel's RSS counters are batched per CPU and read lazily, so a real allocation is not guaranteed to show
    # within a test's time: the fields are faked, and the body waits until the thread has sampled the peak.
    import threading

    from minimax_m3 import bench_loading

    fields = {"RssAnon": 100 << 20, "RssFile": 7 << 20}
    peak_seen = threading.Event()

    def fake_status_field(name):
        value = fields[name]
        if name == "RssAnon" and value == 900 << 20:
            peak_seen.set()
        return value

    monkeypatch.setattr(bench_loading, "_status_field", fake_status_field)
    with bench_loading.HostMemorySampler(interval=0.001) as sampler:
        fields["RssAnon"], fields["RssFile"] = 900 << 20, 20 << 20
        assert peak_seen.wait(timeout=30), "the sampling thread never ran"
        fields["RssAnon"], fields["RssFile"] = 50 << 20, 3 << 20
    assert sampler.peak_anonymous == 900 << 20
    assert sampler.peak_file >= 7 << 20  # RssFile is read after RssAnon in the same sample
    assert not sampler._thread.is_alive()


def test_the_host_memory_sampler_reads_this_process():
    from minimax_m3.bench_loading import HostMemorySampler, _status_field

    if _status_field("RssAnon") is None:
        pytest.skip("no /proc/self/status RssAnon on this system")
    with HostMemorySampler(interval=0.001) as sampler:
        pass
    assert sampler.peak_anonymous > 0 and sampler.peak_file > 0
