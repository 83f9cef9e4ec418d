"""Loading the official, MXFP8 and transformers-native layouts; parity with transformers' native model."""

import json

import pytest
import torch
from safetensors.torch import save_file

from minimax_m3 import MiniMaxM3Config, MiniMaxM3ForCausalLM, load_model
from minimax_m3.conversion import checkpoint_state_dict
from minimax_m3.synthetic_checkpoint import quantize_mxfp8
from test_minimax_m3 import tiny_config, tiny_model


def write_official(model, path, *, quantize=False):
    """The release layout: composite config, `language_model.` keys in two shards with an index, extra keys."""
    path.mkdir()
    text_config = model.config.to_dict()
    text_config["model_type"] = "minimax_m3"
    config = {"model_type": "minimax_m3_vl", "text_config": text_config, "image_token_index": 5}
    state = {f"language_model.{k}": v.contiguous() for k, v in checkpoint_state_dict(model).items()}
    if quantize:
        config["quantization_config"] = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32]}
        for key in list(state):
            keep = key.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight", "norm.weight", "e_score_correction_bias"))
            if key.endswith("proj.weight") or (key.endswith(".weight") and ".experts." in key):
                keep = False
            if not keep and key.endswith(".weight"):
                state[key], state[key + "_scale_inv"] = quantize_mxfp8(state[key])
    state["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(2, 3)
    state["multi_modal_projector.linear_1.weight"] = torch.zeros(2, 2)
    state["language_model.model.mtp.layers.0.eh_proj.weight"] = torch.zeros(2, 2)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for file, names in shards.items():
        save_file({k: state[k] for k in names}, str(path / file))
        weight_map.update({k: file for k in names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))


def drop_official_tensor(path, key):
    """Remove tensor ``key`` from an official-layout checkpoint (its shard and the index)."""
    from safetensors.torch import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop(key)
    tensors = load_file(str(path / shard))
    tensors.pop(key)
    save_file(tensors, str(path / shard))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def dequantize_mxfp8(weight, scale_inv):
    """The MXFP8 reference: ``W = fp8 * 2^(s - 127)``, one uint8 E8M0 exponent ``s`` per 1x32 input block."""
    exponents = scale_inv.to(torch.int32).repeat_interleave(32, dim=1)[:, : weight.shape[1]] - 127
    return weight.to(torch.float32) * torch.pow(2.0, exponents.to(torch.float32))


def test_official_sharded_layout_loads_with_the_same_logits(tmp_path):
    model = tiny_model()
    write_official(model, tmp_path / "official")
    loaded = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "official", dtype=torch.float32)
    ids = torch.randint(3, 97, (1, 40))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.equal(load_model(str(tmp_path / "official"))(ids).logits, model(ids).logits)


def test_mxfp8_release_is_dequantised_at_load(tmp_path):
    model = tiny_model(intermediate_size=64, shared_intermediate_size=64)
    write_official(model, tmp_path / "mxfp8", quantize=True)
    loaded = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "mxfp8", dtype=torch.bfloat16)
    reference = tiny_model(intermediate_size=64, shared_intermediate_size=64)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith("proj.weight") or ".experts." in name:
                rows = parameter.flatten(0, -2)  # packed experts: blocks of 32 along each row's inputs, as per expert
                parameter.copy_(dequantize_mxfp8(*quantize_mxfp8(rows)).view_as(parameter))
    for name, parameter in loaded.named_parameters():
        expected = dict(reference.named_parameters())[name]
        if name.endswith(("block_sparse_moe.gate.weight",)):
            assert parameter.dtype == torch.float32 and torch.equal(parameter, expected)
        else:
            assert parameter.dtype == torch.bfloat16
            assert torch.equal(parameter, expected.to(torch.bfloat16)), name
    assert not torch.equal(reference.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)


def test_the_mxfp8_reference_reads_e8m0_exponents():
    weight = torch.tensor([[1.0, -2.0] + [0.5] * 30 + [3.0] * 32]).to(torch.float8_e4m3fn)
    out = dequantize_mxfp8(weight, torch.tensor([[127, 130]], dtype=torch.uint8))
    assert out[0, 0] == 1.0 and out[0, 1] == -2.0 and out[0, 32] == 24.0


def test_mxfp8_asked_to_stay_fp8_raises_before_loading(tmp_path):
    from transformers import FineGrainedFP8Config

    write_official(tiny_model(intermediate_size=64, shared_intermediate_size=64), tmp_path / "mxfp8", quantize=True)
    config = json.loads((tmp_path / "mxfp8" / "config.json").read_text())
    config["quantization_config"]["dequantize"] = False
    (tmp_path / "mxfp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="dequantize=False"):
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "mxfp8")
    with pytest.raises(ValueError, match="dequantize=False"):
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "mxfp8", quantization_config=FineGrainedFP8Config())


def native_model(**overrides):
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    values = dict(
        vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=48, dense_intermediate_size=96, shared_intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, rotary_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        index_n_heads=2, index_head_dim=32, index_block_size=8, index_topk_blocks=3, index_local_blocks=1,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse", "sparse"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    values.update(overrides)
    config = MiniMaxM3VLTextConfig(**values)
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.1)
    return model


def test_parity_with_transformers_native_model(tmp_path):
    native = native_model()
    native.save_pretrained(tmp_path / "native")
    config = MiniMaxM3Config.from_pretrained(tmp_path / "native", index_dtype="float32")
    ours = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "native", config=config, dtype=torch.float32)
    captured = []
    for layer in native.model.layers:
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.register_forward_hook(lambda module, args, output: captured.append(output))
    for length in (24, 64, 200):  # all pages selected; then real selection (top-3 of 8 and of 25 pages of 8)
        ids = torch.randint(3, 97, (1, length))
        captured.clear()
        expected = native(ids).logits
        output = ours(ids, output_page_selections=True)
        difference = (output.logits - expected).abs().max().item()
        differing = 0
        for native_selection, our_selection in zip(captured, output.page_selections):
            theirs = native_selection[0].permute(1, 0, 2)  # [S, G, k]
            for row_theirs, row_ours in zip(theirs.reshape(-1, theirs.shape[-1]), our_selection[0].reshape(-1, theirs.shape[-1])):
                differing += sorted(p for p in row_theirs.tolist() if p >= 0) != sorted(p for p in row_ours.tolist() if p >= 0)
        print(f"length {length}: max |logit difference| vs transformers' native model {difference:.2e}, "
              f"(token, group) rows with another page set: {differing} of {2 * length * 2}")
        # near-ties between an exact fp32 top-k and the quantised key may legitimately differ; none expected here
        assert differing == 0
        torch.testing.assert_close(output.logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("device_map", ["auto", {"": "cpu"}])
def test_device_maps_for_own_and_converted_layouts(tmp_path, device_map):
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 30))
    expected = model(ids).logits
    model.save_pretrained(tmp_path / "own")
    write_official(model, tmp_path / "official")
    for path in (tmp_path / "own", tmp_path / "official"):
        loaded = MiniMaxM3ForCausalLM.from_pretrained(path, device_map=device_map, dtype=torch.float32)
        torch.testing.assert_close(loaded(ids).logits, expected, atol=0, rtol=0)


def test_incomplete_or_mismatched_checkpoints_raise(tmp_path):
    model = tiny_model()
    write_official(model, tmp_path / "official")
    small = tiny_config(num_local_experts=2)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # transformers' report names the tensors
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "official", config=small)
    with pytest.raises((ValueError, RuntimeError), match="lacks 3 tensors of the model|which the config's model does not"):
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "official", config=tiny_config(moe_layer_freq=[0, 0, 1]))
    drop_official_tensor(tmp_path / "official", "language_model.model.layers.2.self_attn.o_proj.weight")
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "official")


def _disk_device_map():
    return {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def test_every_converted_layout_offloads_to_disk(tmp_path):
    """Official, MXFP8 and transformers-native checkpoints all go through transformers' loader: the same logits with
    two of three layers offloaded to disk as loaded whole."""
    ids = torch.randint(3, 97, (1, 40))
    model = tiny_model()
    write_official(model, tmp_path / "official")
    write_official(tiny_model(intermediate_size=64, shared_intermediate_size=64), tmp_path / "mxfp8", quantize=True)
    native_model().save_pretrained(tmp_path / "native")
    for layout in ("official", "mxfp8", "native"):
        whole = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / layout, dtype=torch.float32)
        offloaded = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / layout, device_map=_disk_device_map(),
                                                         dtype=torch.float32, offload_folder=str(tmp_path / f"offload-{layout}"))
        assert any((tmp_path / f"offload-{layout}").iterdir()), layout
        torch.testing.assert_close(offloaded(ids).logits, whole(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_model_loaded_from_the_native_layout_saves_the_official_names(tmp_path):
    """The native layout's renames and splits apply at load only: a save holds the official names, and it reloads to
    the same logits."""
    from safetensors import safe_open

    native_model().save_pretrained(tmp_path / "native")
    loaded = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32)
    loaded.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
    assert "model.layers.0.mlp.gate_proj.weight" in keys and "model.layers.1.self_attn.index_q_proj.weight" in keys
    assert "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight" in keys
    assert "model.layers.1.block_sparse_moe.gate.weight" in keys
    # the routed experts were read packed, so transformers saves them packed (the model's own names)
    assert "model.layers.1.block_sparse_moe.experts.gate_up_proj" in keys
    assert not any(".indexer." in key or ".mlp.gate_up_proj" in key or ".mlp.gate." in key for key in keys)
    again = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    ids = torch.randint(3, 97, (1, 40))
    assert torch.equal(again(ids).logits, loaded(ids).logits)


def test_an_official_checkpoint_missing_one_expert_matrix_raises_naming_it(tmp_path):
    write_official(tiny_model(), tmp_path / "official")
    drop_official_tensor(tmp_path / "official", "language_model.model.layers.2.block_sparse_moe.experts.3.w3.weight")
    with pytest.raises(RuntimeError, match="CONVERSION"):  # transformers' report names the incomplete expert packing
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "official")


def test_a_hub_id_of_the_official_layout_loads_offline_from_the_hugging_face_cache(tmp_path):
    """The snapshot layout of a populated Hugging Face cache, HF_HUB_OFFLINE=1, from_pretrained("org/name") in a
    fresh process: the same logits as the local directory."""
    import subprocess
    import sys

    model = tiny_model()
    home = tmp_path / "hf-home"
    repository = home / "hub" / "models--minimax-test--tiny-m3-official"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repository / "snapshots").mkdir(parents=True)
    write_official(model, repository / "snapshots" / commit)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    script = (
        "import sys, torch\nfrom minimax_m3 import MiniMaxM3ForCausalLM\n"
        "model = MiniMaxM3ForCausalLM.from_pretrained('minimax-test/tiny-m3-official', dtype=torch.float32)\n"
        f"torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits, {str(tmp_path / 'logits.pt')!r})\n"
    )
    environment = dict(__import__("os").environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "logits.pt"), model(ids).logits)


def test_converted_layouts_take_the_usual_from_pretrained_arguments(tmp_path):
    model = tiny_model(index_dtype="bfloat16")
    write_official(model, tmp_path / "official")
    ids = torch.randint(3, 97, (1, 40))
    loaded = MiniMaxM3ForCausalLM.from_pretrained(
        tmp_path / "official", dtype=torch.float32, index_dtype="float32", attention_mode="dense",
        attn_implementation="eager", experts_implementation="eager", low_cpu_mem_usage=True, device_map="auto",
        max_memory={"cpu": 10 << 30}, trust_remote_code=False)
    assert loaded.config.index_dtype == "float32" and loaded.config.attention_mode == "dense"
    assert loaded.config._attn_implementation == "eager" and loaded.config._experts_implementation == "eager"
    dense = tiny_model(attention_mode="dense")
    torch.testing.assert_close(loaded(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for file in (tmp_path / "official").iterdir():
        text = file.read_text() if file.suffix == ".json" else None
        if text is not None:
            (renamed / file.name).write_text(text.replace("language_model.model.norm.", "language_model.model.final_norm."))
    from safetensors.torch import load_file

    for shard in (tmp_path / "official").glob("*.safetensors"):
        tensors = load_file(str(shard))
        save_file({key.replace(".model.norm.", ".model.final_norm."): value for key, value in tensors.items()},
                  str(renamed / shard.name))
    remapped = MiniMaxM3ForCausalLM.from_pretrained(renamed, dtype=torch.float32,
                                                    key_mapping={r"\.final_norm\.": ".norm."})
    torch.testing.assert_close(remapped(ids).logits, model(ids).logits, atol=0, rtol=0)
    with pytest.raises(TypeError, match="no_such_argument"):
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "official", no_such_argument=1)


def test_a_model_loaded_from_the_official_layout_saves_and_reloads(tmp_path):
    """transformers saves it back with the official key prefix (the conversion it used) and reads that again."""
    model = tiny_model()
    write_official(model, tmp_path / "official")
    loaded = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "official", dtype=torch.float32)
    loaded.save_pretrained(tmp_path / "saved")
    again = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.randint(3, 97, (1, 40))
    assert torch.equal(again(ids).logits, model(ids).logits)
    fresh = tiny_model()
    fresh.save_pretrained(tmp_path / "fresh")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fresh" / "model.safetensors"), framework="pt") as handle:
        assert not any(key.startswith("language_model.") for key in handle.keys())
