"""transformers conventions the model follows (CPU, tiny config whose sparse layers drop pages): RoPE scaling through
``rope_parameters``, the native config's rotary share, fp16 loading with an fp32 router, gradient checkpointing."""

import functools
import json
import logging

import pytest
import torch

from minimax_m3 import MiniMaxM3Config, MiniMaxM3ForCausalLM
from minimax_m3.modeling_minimax_m3 import MiniMaxM3RotaryEmbedding
from test_minimax_m3 import tiny_config, tiny_model
from test_minimax_m3_loading import native_model

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64},
}


# ------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_rope_scaling_matches_transformers_native_model(tmp_path, scaling):
    """Logits and page sets of transformers' own MiniMax-M3 with the same ``rope_parameters`` (its RoPE is
    transformers' rotary embedding: an independent path to the same frequencies and attention scaling); lengths
    within and beyond ``max_position_embeddings`` (where a dynamic RoPE rescales)."""
    rope = dict(SCALINGS[scaling], rope_theta=5e6, partial_rotary_factor=0.5)
    native = native_model(rope_parameters=rope, max_position_embeddings=96)
    native.save_pretrained(tmp_path)
    config = MiniMaxM3Config.from_pretrained(tmp_path, index_dtype="float32")
    assert config.rope_type == scaling
    ours = MiniMaxM3ForCausalLM.from_pretrained(tmp_path, config=config, dtype=torch.float32)
    plain = native_model(max_position_embeddings=96)
    for length in (40, 150):
        ids = torch.randint(3, 97, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected, got, unscaled = native(ids).logits, ours(ids).logits, plain(ids).logits
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        # the scaling really acts (a dynamic RoPE only beyond max_position_embeddings)
        changes = scaling != "dynamic" or length > 96
        assert ((got - unscaled).abs().max() > 1e-3) == changes, (scaling, length)


def test_rope_scaling_of_the_hub_spelling_is_saved_as_rope_scaling(tmp_path):
    config = tiny_config(rope_scaling=dict(SCALINGS["yarn"]), max_position_embeddings=128)
    assert config.rope_type == "yarn"
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_scaling"] == SCALINGS["yarn"] and "rope_parameters" not in saved
    reloaded = MiniMaxM3Config.from_pretrained(tmp_path)
    assert reloaded.rope_type == "yarn" and reloaded.rope_parameters["factor"] == 2.0
    first, second = MiniMaxM3RotaryEmbedding(config), MiniMaxM3RotaryEmbedding(reloaded)
    assert torch.equal(first.inv_freq, second.inv_freq) and first.attention_scaling == second.attention_scaling != 1.0


def test_a_rope_type_the_model_cannot_serve_raises():
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        tiny_config(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8})


def test_the_native_configs_rotary_share_wins_over_a_stale_rotary_dim(caplog):
    """head_dim 16 with ``partial_rotary_factor`` 0.5 rotates 8 dimensions, as transformers' native model does,
    whatever a stale ``rotary_dim`` says (it is logged)."""
    flat = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, index_n_heads=2, index_head_dim=16, layer_types=["full_attention", "minimax_m3_sparse"],
                mlp_layer_types=["dense", "dense"])
    with caplog.at_level(logging.WARNING):
        config = MiniMaxM3Config(**flat, rotary_dim=64,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    assert config.rotary_dim == 8 and "rotary_dim 64 is ignored" in caplog.text
    model = MiniMaxM3ForCausalLM(config).eval()
    assert model.model.rotary_emb.inv_freq.numel() == 4
    assert torch.isfinite(model(torch.randint(3, 97, (1, 20))).logits).all()


# ------------------------------------------------------------------ dtypes
def test_fp16_loading_keeps_only_the_router_in_fp32(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    half = MiniMaxM3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
    dtypes = {name: parameter.dtype for name, parameter in half.named_parameters()}
    routers = [name for name in dtypes if name.endswith("block_sparse_moe.gate.weight")]
    assert routers and all(dtypes[name] is torch.float32 for name in routers)
    assert all(dtype is torch.float16 for name, dtype in dtypes.items() if name not in routers)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (half(ids).logits.float() - model(ids).logits).abs().max()
    assert difference < 0.05, difference


# ------------------------------------------------------------------ training
def test_gradient_checkpointing_recomputes_the_layers_and_gives_the_same_gradients():
    ids = torch.randint(3, 97, (2, 60), generator=torch.Generator().manual_seed(1))

    def train_step(checkpointing: bool):
        model = tiny_model(seed=3).train()
        if checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        attention_calls = []
        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(lambda *args: attention_calls.append(1))
        output = model(ids, labels=ids, output_page_selections=True)
        output.loss.backward()
        gradients = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        return output, gradients, len(attention_calls)

    plain, plain_gradients, plain_calls = train_step(False)
    checkpointed, gradients, calls = train_step(True)
    assert plain_calls == 3 and calls == 6  # every layer ran again in the backward pass
    assert torch.equal(plain.loss, checkpointed.loss)
    assert all(torch.equal(a, b) for a, b in zip(plain.page_selections, checkpointed.page_selections))
    assert gradients.keys() == plain_gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, plain_gradients[name], atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------ outputs and arguments
def test_outputs_are_transformers_moe_outputs_and_tuples_on_request():
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

    model = tiny_model()
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    output = model(ids, attention_mask=mask, output_page_selections=True)
    assert isinstance(output, MoeCausalLMOutputWithPast) and output.page_selections is not None
    assert isinstance(model.model(ids, attention_mask=mask), MoeModelOutputWithPast)
    as_tuple = model(ids, attention_mask=mask, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], output.logits)
    assert isinstance(model.model(ids, attention_mask=mask, return_dict=False), tuple)


def test_hidden_states_are_the_embeddings_every_layer_input_and_the_last_hidden_state():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    output = model.model(ids, attention_mask=mask, output_hidden_states=True)
    states = output.hidden_states
    assert len(states) == model.config.num_hidden_layers + 1
    assert all(state.shape == (2, 30, model.config.hidden_size) for state in states)
    real = mask.bool()
    torch.testing.assert_close(states[0][real], model.model.embed_tokens(ids)[real])
    assert torch.equal(states[-1], output.last_hidden_state)
    assert model.model(ids, attention_mask=mask).hidden_states is None
    # a query-chunked forward (a small score budget) gives the same states
    model.config.max_score_buffer_bytes = 4 * 2 * 2 * 8 * 10
    chunked = model.model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    for a, b in zip(chunked, states):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5)


def test_position_ids_are_honoured_when_they_match_and_raise_otherwise():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    expected = model(ids, attention_mask=mask).logits
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # what generate() and tokenizers' collators build
    assert torch.equal(model(ids, attention_mask=mask, position_ids=positions).logits, expected)
    packed = torch.cat([torch.arange(15), torch.arange(15)])[None]  # two packed sequences restarting at 0
    with pytest.raises(ValueError, match="packed sequences that restart their positions are not supported"):
        model(ids[:1], position_ids=packed)
    with pytest.raises(ValueError, match="position_ids must be"):
        model(ids, position_ids=torch.arange(29)[None])


# ------------------------------------------------------------------ generate
def test_generate_from_inputs_embeds_gives_the_tokens_of_generate_from_ids():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    from_ids = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask,
                                 max_new_tokens=6, do_sample=False)
    assert torch.equal(from_embeds, from_ids[:, 30:])  # generate() returns only the new tokens for embeddings
    # without a mask (transformers also drops an all-ones one): the new columns are counted past the embeddings
    unmasked = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for mask in (None, torch.ones_like(ids)):
        from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask,
                                     max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(from_embeds, unmasked[:, 30:])


def test_a_generation_from_inputs_embeds_continues_with_its_cache():
    """Continuing: the generated ids, the mask over every column so far, and the returned cache."""
    from test_minimax_m3 import CACHE_FIELD

    model = tiny_model()
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    whole = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    first = model.generate(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask, max_new_tokens=3,
                           do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    generated = first.sequences
    full_mask = torch.cat([mask, torch.ones_like(generated)], dim=1)
    continued = model.generate(generated, attention_mask=full_mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                               **{CACHE_FIELD: first[CACHE_FIELD]})
    assert torch.equal(continued, whole[:, 30:])


def test_a_generation_continues_from_longer_embeddings_over_its_cache():
    """The prompt's embeddings plus the generated token's, with the returned cache: only the new column runs."""
    from test_minimax_m3 import CACHE_FIELD

    model = tiny_model()
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(7))
    embed = model.get_input_embeddings()
    whole = model.generate(inputs_embeds=embed(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    first = model.generate(inputs_embeds=embed(ids), max_new_tokens=1, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True)
    longer = torch.cat([embed(ids), embed(first.sequences)], dim=1)
    continued = model.generate(inputs_embeds=longer, max_new_tokens=4, do_sample=False, pad_token_id=0,
                               **{CACHE_FIELD: first[CACHE_FIELD]})
    assert torch.equal(torch.cat([first.sequences, continued], dim=1), whole)


def test_generate_forwards_the_models_own_keywords(monkeypatch):
    model = tiny_model()
    seen = []
    forward = type(model).forward

    @functools.wraps(forward)  # generate() checks its keywords against the forward's signature
    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("output_page_selections"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    ids = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(6))
    model.generate(ids, max_new_tokens=3, do_sample=False, output_page_selections=True)
    assert seen == [True, True, True]


# ------------------------------------------------------------------ cache
def test_continuing_a_filled_cache_in_another_dtype_raises_instead_of_dropping_its_history():
    from minimax_m3.modeling_minimax_m3 import CACHE_FIELD

    model = tiny_model()
    ids = torch.randint(3, 97, (1, 30), generator=torch.Generator().manual_seed(7))
    cache = model(ids[:, :20], use_cache=True)[CACHE_FIELD]
    lengths = list(cache.lengths)
    model.to(torch.float64)
    with pytest.raises(ValueError, match="continue a filled cache with the dtype and device it was filled with"):
        model(ids[:, 20:], past_key_values=cache, use_cache=True)
    assert cache.lengths == lengths  # nothing advanced
    model.to(torch.float32)  # back in the cache's dtype: the continuation is the one-forward result
    continued = model(ids[:, 20:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(continued, model(ids).logits[:, 20:], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ loading
def test_an_own_layout_checkpoint_missing_a_tensor_raises_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model().save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(str(file))
    tensors.pop("model.layers.1.block_sparse_moe.gate.weight")
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors of the model: \['model.layers.1.block_sparse_moe.gate.weight'\]"):
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path)


def test_a_tensor_in_two_shards_of_an_official_checkpoint_raises_naming_both_files(tmp_path):
    from safetensors.torch import load_file, save_file
    from test_minimax_m3_loading import write_official

    write_official(tiny_model(), tmp_path / "official")
    index = json.loads((tmp_path / "official" / "model.safetensors.index.json").read_text())
    key = "language_model.model.norm.weight"
    files = sorted(set(index["weight_map"].values()))
    other = next(file for file in files if file != index["weight_map"][key])
    source = load_file(str(tmp_path / "official" / index["weight_map"][key]))
    tensors = load_file(str(tmp_path / "official" / other))
    tensors[key] = source[key] + 1  # a second, different copy
    save_file(tensors, str(tmp_path / "official" / other))
    with pytest.raises(ValueError, match=f"tensor {key} is in both model-0000[12]-of-00002.safetensors and "):
        MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "official")


# ------------------------------------------------------------------ offload
def test_cpu_and_disk_offload_give_the_same_logits(tmp_path):
    """accelerate's hooks move the weights and the layers' inputs (the forward never reads parameter devices): a
    device_map with disk-offloaded layers, device_map="auto" under a memory cap, and cpu_offload / disk_offload."""
    from accelerate import cpu_offload, disk_offload

    model = tiny_model()
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    expected = model(ids, attention_mask=mask).logits
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    on_disk = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                   offload_folder=str(tmp_path / "offload"))
    assert on_disk.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    torch.testing.assert_close(on_disk(ids, attention_mask=mask).logits, expected, atol=1e-5, rtol=1e-5)
    capped = MiniMaxM3ForCausalLM.from_pretrained(tmp_path / "model", device_map="auto", max_memory={"cpu": 60_000},
                                                  offload_folder=str(tmp_path / "auto"), low_cpu_mem_usage=True)
    assert any(p.device.type == "meta" for p in capped.parameters())
    torch.testing.assert_close(capped(ids, attention_mask=mask).logits, expected, atol=1e-5, rtol=1e-5)
    for offload in (lambda m: cpu_offload(m, execution_device="cpu"),
                    lambda m: disk_offload(m, str(tmp_path / "disk"), execution_device="cpu")):
        offloaded = tiny_model()
        offload(offloaded)
        torch.testing.assert_close(offloaded(ids, attention_mask=mask).logits, expected, atol=1e-5, rtol=1e-5)
    generated = on_disk.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                                 pad_token_id=0))


def test_our_layout_takes_the_usual_from_pretrained_arguments(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path / "model")
    loaded = MiniMaxM3ForCausalLM.from_pretrained(
        tmp_path / "model", dtype=torch.float32, device_map="auto", max_memory={"cpu": 60_000},
        offload_folder=str(tmp_path / "offload"), offload_state_dict=True, low_cpu_mem_usage=True,
        attn_implementation="eager", experts_implementation="batched_mm", key_mapping={r"^model\.norm\.": "model.norm."},
        index_dtype="float32", attention_mode="dense")
    assert (loaded.config._attn_implementation, loaded.config._experts_implementation) == ("eager", "batched_mm")
    assert loaded.config.attention_mode == "dense" and any(p.device.type == "meta" for p in loaded.parameters())
    ids = torch.randint(3, 97, (1, 30))
    torch.testing.assert_close(loaded(ids).logits, tiny_model(attention_mode="dense")(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_state_dict_load_the_fp32_module_names_and_a_request_for_attention_weights(tmp_path):
    """from_pretrained(None, config=, state_dict=) builds the model; the fp32 list names the router module; attention
    weights, which the model never forms, are refused instead of silently missing."""
    model = tiny_model()
    rebuilt = MiniMaxM3ForCausalLM.from_pretrained(None, config=model.config, state_dict=model.state_dict())
    ids = torch.randint(3, 97, (1, 30))
    assert torch.equal(rebuilt(ids).logits, model(ids).logits)
    names = {name for name, _ in model.named_modules()}
    assert all(any(name.endswith(pattern) for name in names) for pattern in model._keep_in_fp32_modules)
    with pytest.raises(ValueError, match="output_attentions is not supported"):
        model(ids, output_attentions=True)
