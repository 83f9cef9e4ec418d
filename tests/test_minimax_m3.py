"""The minimax_m3 model on CPU: config spellings, layer math, sparse vs dense, cache, padding, generate, save/load."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import minimax_m3  # noqa: F401  (registers the Auto classes)
from minimax_m3 import MiniMaxM3Config, MiniMaxM3ForCausalLM
from minimax_m3.conversion import checkpoint_state_dict
from minimax_m3.modeling_minimax_m3 import (
    CACHE_FIELD,
    MiniMaxM3RMSNorm,
    MiniMaxM3SparseMoeBlock,
    apply_partial_rope,
    swiglu_oai,
)
from minimax_m3.sparse_attention import recent_page_selection

SPARSE_CONFIG = {
    "use_sparse_attention": True,
    "sparse_attention_freq": [0, 1, 1],
    "sparse_num_index_heads": 2,
    "sparse_index_dim": 32,
    "sparse_block_size": 8,
    "sparse_topk_blocks": 3,
    "sparse_init_block": 0,
    "sparse_local_block": 1,
    "sparse_score_type": "max",
}


def tiny_config(**overrides) -> MiniMaxM3Config:
    values = dict(
        vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=48, dense_intermediate_size=96, shared_intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, rotary_dim=16, partial_rotary_factor=0.5, rope_theta=5e6,
        sparse_attention_config=dict(SPARSE_CONFIG), moe_layer_freq=[0, 1, 1], bos_token_id=1, eos_token_id=2,
        pad_token_id=0, index_dtype="float32",
    )
    values.update(overrides)
    return MiniMaxM3Config(**values)


def tiny_model(seed=0, **overrides) -> MiniMaxM3ForCausalLM:
    torch.manual_seed(seed)
    model = MiniMaxM3ForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.1)
    return model


# ------------------------------------------------------------------ config
def test_nested_and_flat_spellings_agree_and_are_kept_when_saving(tmp_path):
    nested = tiny_config()
    flat = MiniMaxM3Config(
        **{k: v for k, v in nested.to_dict().items() if k not in ("sparse_attention_config", "moe_layer_freq")},
        index_n_heads=2, index_head_dim=32, index_block_size=8, index_topk_blocks=3, index_local_blocks=1,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse", "sparse"],
    )
    for name in ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "layer_types", "mlp_layer_types", "rotary_dim"):
        assert getattr(nested, name) == getattr(flat, name), name
    nested.save_pretrained(tmp_path / "nested")
    saved = json.loads((tmp_path / "nested" / "config.json").read_text())
    assert "sparse_attention_config" in saved and "layer_types" not in saved and "index_n_heads" not in saved
    flat.save_pretrained(tmp_path / "flat")
    saved = json.loads((tmp_path / "flat" / "config.json").read_text())
    assert "layer_types" in saved and "sparse_attention_config" not in saved
    assert AutoConfig.from_pretrained(tmp_path / "nested").layer_types == nested.layer_types


def test_rope_parameters_spelling_sets_the_partial_rotary_dim():
    config = tiny_config(rotary_dim=None, partial_rotary_factor=None, rope_theta=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    assert config.rotary_dim == 8 and config.rope_theta == 1e4


def test_official_composite_config_yields_the_text_config(tmp_path):
    text = tiny_config().to_dict()
    text["model_type"] = "minimax_m3"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "minimax_m3_vl", "text_config": text, "image_token_index": 5}))
    config = MiniMaxM3Config.from_pretrained(tmp_path)
    assert config.model_type == "minimax_m3" and config.num_hidden_layers == 3 and config.index_topk_blocks == 3


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(sparse_attention_config={**SPARSE_CONFIG, "sparse_num_index_heads": 4}), "index_n_heads"),
        (dict(num_attention_heads=3), "multiple of num_key_value_heads"),
        (dict(rotary_dim=7), "rotary_dim"),
        (dict(moe_layer_freq=[0, 1]), "mlp_layer_types must have"),
        (dict(sparse_attention_config={**SPARSE_CONFIG, "sparse_init_block": 1}), "sparse_init_block"),
        (dict(sparse_attention_config={**SPARSE_CONFIG, "sparse_local_block": 2}), "index_local_blocks"),
        (dict(index_dtype="int8"), "index_dtype"),
        (dict(attention_mode="linear"), "attention_mode"),
        (dict(moe_implementation="grouped"), "moe_implementation"),
    ],
)
def test_bad_configs_raise_clear_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


# ------------------------------------------------------------------ layer math
def test_gemma_rmsnorm():
    norm = MiniMaxM3RMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    x32 = x.float()
    expected = (x32 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)).to(torch.bfloat16)
    assert torch.equal(norm(x), expected)


def test_partial_neox_rope_rotates_only_the_first_dims():
    x = torch.randn(5, 2, 32)
    positions = torch.arange(5).float()
    inv_freq = 5e6 ** (-torch.arange(0, 16, 2).double() / 16)
    angles = positions[:, None].double() * inv_freq[None]
    out = apply_partial_rope(x, angles.cos().float(), angles.sin().float())
    assert torch.equal(out[..., 16:], x[..., 16:])
    for i in range(8):  # pairs (i, i + 8) inside the rotated 16 dims
        c, s = angles.cos()[:, None, i].float(), angles.sin()[:, None, i].float()
        torch.testing.assert_close(out[..., i], x[..., i] * c - x[..., i + 8] * s)
        torch.testing.assert_close(out[..., i + 8], x[..., i + 8] * c + x[..., i] * s)


def test_swiglu_oai():
    gate = torch.tensor([-9.0, -1.0, 0.5, 8.0])
    up = torch.tensor([-8.0, 0.0, 2.0, 9.0])
    g = torch.tensor([-9.0, -1.0, 0.5, 7.0])
    u = torch.tensor([-7.0, 0.0, 2.0, 7.0])
    torch.testing.assert_close(swiglu_oai(gate, up, 1.702, 7.0, 1.0), g * torch.sigmoid(1.702 * g) * (u + 1))


def test_router_selects_with_bias_and_weights_without_it():
    config = tiny_config()
    block = MiniMaxM3SparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.normal_()
        block.e_score_correction_bias.copy_(torch.tensor([0.0, 5.0, 0.0, 0.0]))  # forces expert 1 in
    x = torch.randn(6, config.hidden_size)
    chosen, weights, logits = block.route(x)
    torch.testing.assert_close(logits, x @ block.gate.weight.T)
    p = torch.sigmoid(x @ block.gate.weight.T)
    assert bool((chosen == 1).any(dim=1).all())
    expected = p.gather(1, chosen) / p.gather(1, chosen).sum(1, keepdim=True) * 2.0
    torch.testing.assert_close(weights, expected)
    assert block.gate.weight.dtype == torch.float32 and block.e_score_correction_bias.dtype == torch.float32


def expert_reference(config, w1, w3, w2, x):
    """One expert as the checkpoint's three matrices define it: ``w2 @ swiglu_oai(w1 @ x, w3 @ x)``."""
    return w2 @ swiglu_oai(w1 @ x, w3 @ x, config.swiglu_alpha, config.swiglu_limit, config.swiglu_beta)


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm", "batched_mm"])
def test_moe_block_matches_per_token_expert_sum(experts_implementation):
    config = tiny_config(experts_implementation=experts_implementation)
    torch.manual_seed(3)
    block = MiniMaxM3SparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.normal_()
        block.experts.gate_up_proj.normal_(std=0.2)
        block.experts.down_proj.normal_(std=0.2)
    x = torch.randn(10, config.hidden_size)
    chosen, weights, logits = block.route(x)
    width = config.intermediate_size
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    expected = torch.stack([
        sum(weights[t, k] * expert_reference(config, gate_up[e, :width], gate_up[e, width:], down[e], x[t])
            for k, e in enumerate(chosen[t].tolist()))
        + block.shared_experts(x[t])
        for t in range(x.shape[0])])
    output, router_logits = block(x)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(router_logits, logits)


# ------------------------------------------------------------------ attention modes, cache, padding
def test_sparse_equals_dense_while_every_position_has_at_most_topk_pages():
    sparse, dense = tiny_model(), tiny_model(attention_mode="dense")
    dense.load_state_dict(sparse.state_dict())
    ids = torch.randint(3, 97, (2, 24))  # 3 pages of 8 = topk
    torch.testing.assert_close(sparse(ids).logits, dense(ids).logits, atol=1e-5, rtol=0)
    longer = torch.randint(3, 97, (2, 48))
    assert (sparse(longer).logits - dense(longer).logits).abs().max() > 1e-3  # selection really drops pages


@pytest.mark.parametrize("implementation", ["reference", "masked"])
def test_sparse_attention_equals_masked_dense_attention_over_the_selected_pages(implementation):
    """An independent formulation: full attention with an additive mask built from the selected pages."""
    from minimax_m3.sparse_attention import SPARSE_ATTENTION_FUNCTIONS, ForwardMetadata

    torch.manual_seed(3)
    tokens, heads, kv_heads, dim, page = 40, 4, 2, 16, 8
    q = torch.randn(tokens, heads, dim)
    keys = torch.randn(1, tokens, kv_heads, dim)
    values = torch.randn(1, tokens, kv_heads, dim)
    positions = torch.arange(tokens)
    selection = torch.full((tokens, kv_heads, 3), -1, dtype=torch.int32)
    for t in range(tokens):
        for g in range(kv_heads):
            local = t // page
            history = torch.randperm(local)[:2] if local else torch.tensor([], dtype=torch.long)
            chosen = sorted(set(history.tolist())) + [local]
            selection[t, g, : len(chosen)] = torch.tensor(chosen)
    metadata = ForwardMetadata(torch.zeros(tokens, dtype=torch.long), positions, [tokens], [tokens], [0])
    got = SPARSE_ATTENTION_FUNCTIONS[implementation](q, keys, values, selection, metadata, scale=dim ** -0.5,
                                                     page_size=page)
    for t in range(tokens):
        for h in range(heads):
            g = h // (heads // kv_heads)
            allowed = torch.zeros(tokens, dtype=torch.bool)
            for p in selection[t, g].tolist():
                if p >= 0:
                    allowed[p * page : (p + 1) * page] = True
            allowed &= torch.arange(tokens) <= t
            logits = (keys[0, :, g] @ q[t, h]) * dim ** -0.5
            weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=0)
            torch.testing.assert_close(got[t, h], weights @ values[0, :, g])


def test_masked_sparse_attention_equals_the_reference_on_a_varlen_batch_with_cached_prefixes():
    from minimax_m3.sparse_attention import ForwardMetadata, sparse_attention_masked, sparse_attention_reference

    torch.manual_seed(4)
    page, topk, heads, kv_heads, dim = 8, 3, 4, 2, 16
    query_lengths, kv_lengths = [5, 30, 1], [45, 30, 17]
    capacity = max(kv_lengths)
    keys, values = torch.randn(3, capacity, kv_heads, dim), torch.randn(3, capacity, kv_heads, dim)
    positions = torch.cat([torch.arange(kv - n, kv) for n, kv in zip(query_lengths, kv_lengths)])
    batch_index = torch.cat([torch.full((n,), b) for b, n in enumerate(query_lengths)])
    selection = torch.full((len(positions), kv_heads, topk), -1, dtype=torch.int32)
    for t, p in enumerate(positions.tolist()):
        for g in range(kv_heads):
            local = p // page
            chosen = sorted(torch.randperm(local)[: topk - 1].tolist()) + [local] if local else [0]
            selection[t, g, : len(chosen)] = torch.tensor(chosen)
    metadata = ForwardMetadata(batch_index, positions, query_lengths, kv_lengths, [0, 5, 35])
    q = torch.randn(len(positions), heads, dim)
    expected = sparse_attention_reference(q, keys, values, selection, metadata, scale=0.25, page_size=page)
    for chunk_elements in (1 << 26, 300):  # one chunk, and many small ones
        got = sparse_attention_masked(q, keys, values, selection, metadata, scale=0.25, page_size=page,
                                      chunk_elements=chunk_elements)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("index_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_chunked_prefill_and_decode_equal_one_full_forward(index_dtype):
    model = tiny_model(index_dtype=index_dtype)
    ids = torch.randint(3, 97, (2, 44))
    full = model(ids).logits
    output = model(ids[:, :29], use_cache=True)
    cache = output[CACHE_FIELD]
    pieces = [output.logits]
    pieces.append(model(ids[:, 29:37], past_key_values=cache).logits)  # a chunk over a cached prefix
    for t in range(37, 44):
        pieces.append(model(ids[:, t : t + 1], past_key_values=cache).logits)  # decode
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention_mode", ["sparse", "dense"])
def test_a_repeated_prefix_cache_scores_continuations_like_full_forwards(attention_mode):
    model = tiny_model(attention_mode=attention_mode)
    prefix, continuations = torch.randint(3, 97, (1, 37)), torch.randint(3, 97, (3, 6))
    full = model(torch.cat([prefix.expand(3, -1), continuations], 1)).logits
    output = model(prefix, use_cache=True)
    cache = output[CACHE_FIELD]
    cache.batch_repeat_interleave(3)
    assert cache.batch_size == 3 and cache.lengths == [37, 37, 37]
    continued = model(continuations, past_key_values=cache).logits
    torch.testing.assert_close(continued, full[:, 37:], atol=1e-5, rtol=0)
    torch.testing.assert_close(output.logits.expand(3, -1, -1), full[:, :37], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="repeats"):
        cache.batch_repeat_interleave(0)


def test_left_padding_is_anchored_per_sequence():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 41))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    padded = model(ids, attention_mask=mask, output_page_selections=True)
    alone = model(ids[1:, 9:], output_page_selections=True)
    torch.testing.assert_close(padded.logits[1, 9:], alone.logits[0], atol=1e-5, rtol=0)
    for batched, single in zip(padded.page_selections, alone.page_selections):
        assert torch.equal(batched[1, 9:], single[0])


def test_recent_page_selection_is_the_sliding_window_in_the_indexer_format():
    positions = torch.tensor([0, 7, 8, 23, 24, 60])
    selection = recent_page_selection(positions, 2, page_size=8, topk=3)
    expected = [[0, -1, -1], [0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [5, 6, 7]]
    assert selection.dtype == torch.int32 and selection.shape == (6, 2, 3)
    assert selection[:, 0].tolist() == expected and torch.equal(selection[:, 0], selection[:, 1])


def test_recent_page_selection_model_attends_to_the_last_pages_only():
    recent = tiny_model(page_selection="recent")
    ids = torch.randint(3, 97, (1, 50))
    selections = recent(ids, output_page_selections=True).page_selections
    for selection in selections:
        for t, expected in ((5, [0, -1, -1]), (30, [1, 2, 3]), (49, [4, 5, 6])):
            assert selection[0, t, 0].tolist() == expected and selection[0, t, 1].tolist() == expected
    indexer = tiny_model()  # same weights: only the selection differs
    assert (recent(ids).logits[0, 40:] - indexer(ids).logits[0, 40:]).abs().max() > 1e-4


def test_page_selections_are_observable_and_follow_the_contract():
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 50))
    selections = model(ids, output_page_selections=True).page_selections
    assert len(selections) == 2  # the two sparse layers
    for selection in selections:
        assert selection.shape == (1, 50, 2, 3)
        for t in range(50):
            local = t // 8
            for g in range(2):
                row = selection[0, t, g].tolist()
                valid = [p for p in row if p >= 0]
                assert valid[-1] == local and len(set(valid)) == len(valid) and all(p <= local for p in valid)
                assert len(valid) == min(3, local + 1)


def test_generate_matches_greedy_recomputation_with_and_without_padding():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 30))
    generated = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    sequence = ids.clone()
    for _ in range(6):
        sequence = torch.cat([sequence, model(sequence).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(generated, sequence)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    padded = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    alone = model.generate(ids[1:, 5:], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(padded[1, 5:], alone[0])


def test_logits_to_keep():
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 20))
    full = model(ids).logits
    last = model(ids, logits_to_keep=1).logits
    assert last.shape == (1, 1, 97)
    torch.testing.assert_close(last[:, 0], full[:, -1])


# ------------------------------------------------------------------ weights
def test_parameter_names_are_the_checkpoint_names():
    names = set(checkpoint_state_dict(tiny_model()))  # the routed experts are held packed, saved per expert
    for expected in (
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.index_q_proj.weight", "model.layers.1.self_attn.index_k_proj.weight",
        "model.layers.1.self_attn.index_q_norm.weight", "model.layers.1.self_attn.index_k_norm.weight",
        "model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.e_score_correction_bias",
        "model.layers.1.block_sparse_moe.experts.3.w1.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight",
        "model.layers.1.block_sparse_moe.experts.3.w3.weight",
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
    ):
        assert expected in names, expected
    assert not any("index_" in n for n in names if n.startswith("model.layers.0."))


def test_save_and_load_round_trip_through_auto_classes(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, MiniMaxM3ForCausalLM)
    ids = torch.randint(3, 97, (1, 40))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    moe = bf16.model.layers[1].block_sparse_moe
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32


def test_dense_attention_query_chunks_give_the_same_result(monkeypatch):
    from minimax_m3 import dense_attention

    model = tiny_model(attention_mode="dense")
    ids = torch.randint(3, 97, (1, 40))
    cache = model(ids[:, :10], use_cache=True)[CACHE_FIELD]
    reference = model(ids[:, 10:], past_key_values=cache).logits
    monkeypatch.setattr(dense_attention, "_MASK_ELEMENTS", 64)  # chunks of one or two queries
    cache = model(ids[:, :10], use_cache=True)[CACHE_FIELD]
    torch.testing.assert_close(model(ids[:, 10:], past_key_values=cache).logits, reference, atol=1e-5, rtol=0)


def test_long_prompts_run_in_query_chunks_within_the_score_buffer_budget():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 50))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    expected = model(ids, attention_mask=mask, output_page_selections=True)
    budget = tiny_model(max_score_buffer_bytes=4 * 2 * 2 * 7 * 9)  # about 9 columns per chunk at 7 pages
    budget.load_state_dict(model.state_dict())
    got = budget(ids, attention_mask=mask, output_page_selections=True)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=0)
    for a, b in zip(got.page_selections, expected.page_selections):
        assert torch.equal(a[mask.bool()], b[mask.bool()])


def test_flex_sparse_attention_matches_the_reference():
    import warnings

    reference, flex = tiny_model(), tiny_model(sparse_attention_implementation="flex")
    flex.load_state_dict(reference.state_dict())
    ids = torch.randint(3, 97, (2, 45))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with warnings.catch_warnings(), torch.no_grad():  # FlexAttention has no CPU backward
        warnings.simplefilter("ignore")  # eager (unfused) FlexAttention on CPU warns
        got = flex(ids, attention_mask=mask).logits
        cache = flex(ids[:, :30], attention_mask=mask[:, :30], use_cache=True)[CACHE_FIELD]
        chunked = flex(ids[:, 30:], attention_mask=mask, past_key_values=cache).logits
    expected = reference(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked[mask[:, 30:].bool()], expected[:, 30:][mask[:, 30:].bool()], atol=1e-5, rtol=0)


def test_prefill_benchmark_smoke_run(capsys, tmp_path):
    from minimax_m3 import bench_prefill

    bench_prefill.main(["--lengths", "40", "--repeats", "1", "--modes", "sparse,dense", "--output", str(tmp_path / "r.json")])
    printed = capsys.readouterr().out
    assert "| 40 | sparse |" in printed and "| 40 | dense |" in printed
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["partial"] is False
    results = saved["results"]
    assert {r["mode"] for r in results} == {"sparse", "dense"} and all(r["seconds"] > 0 for r in results)


@pytest.mark.parametrize("shared_selection", [True, False])
def test_flex_full_and_partial_blocks_match_the_reference(shared_selection):
    """Selections shared by whole query blocks give FlexAttention full blocks (no mask_mod); random ones partial."""
    from minimax_m3.sparse_attention import ForwardMetadata, sparse_attention_flex, sparse_attention_reference

    torch.manual_seed(5)
    tokens, past, heads, kv_heads, dim, page = 48, 64, 4, 2, 16, 8
    kv = past + tokens
    q = torch.randn(tokens, heads, dim)
    keys = torch.randn(1, kv, kv_heads, dim)
    values = torch.randn(1, kv, kv_heads, dim)
    positions = torch.arange(past, kv)
    selection = torch.full((tokens, kv_heads, 4), -1, dtype=torch.int32)
    for t in range(tokens):
        local = int(positions[t]) // page
        for g in range(kv_heads):
            rng = torch.Generator().manual_seed((t // 8 if shared_selection else t) * 7 + g)
            history = torch.randperm(past // page, generator=rng)[:3].sort().values
            selection[t, g] = torch.cat([history, torch.tensor([local])]).int()
    metadata = ForwardMetadata(torch.zeros(tokens, dtype=torch.long), positions, [tokens], [kv], [0])
    with torch.no_grad():
        expected = sparse_attention_reference(q, keys, values, selection, metadata, scale=0.25, page_size=page)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = sparse_attention_flex(q, keys, values, selection, metadata, scale=0.25, page_size=page, query_block=8)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_flex_serves_groups_that_do_not_divide_its_row_tile():
    """3 query heads per KV group (the converted SmolLM2): the default query block is 384 rows, 128 tokens."""
    from minimax_m3.sparse_attention import ForwardMetadata, sparse_attention_flex, sparse_attention_reference

    torch.manual_seed(6)
    tokens, past, heads, kv_heads, dim, page = 150, 64, 9, 3, 16, 8
    kv = past + tokens
    q, keys, values = torch.randn(tokens, heads, dim), torch.randn(1, kv, kv_heads, dim), torch.randn(1, kv, kv_heads, dim)
    positions = torch.arange(past, kv)
    selection = torch.full((tokens, kv_heads, 4), -1, dtype=torch.int32)
    for t in range(tokens):
        local = int(positions[t]) // page
        for g in range(kv_heads):
            history = torch.randperm(local, generator=torch.Generator().manual_seed(t * 7 + g))[:3].sort().values
            selection[t, g, :history.numel()] = history.int()
            selection[t, g, 3] = local
    metadata = ForwardMetadata(torch.zeros(tokens, dtype=torch.long), positions, [tokens], [kv], [0])
    with torch.no_grad():
        expected = sparse_attention_reference(q, keys, values, selection, metadata, scale=0.25, page_size=page)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = sparse_attention_flex(q, keys, values, selection, metadata, scale=0.25, page_size=page)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_beam_search_with_the_cache_equals_without():
    model = tiny_model()
    ids = torch.randint(3, 97, (1, 20))
    settings = dict(max_new_tokens=4, num_beams=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(ids, **settings), model.generate(ids, use_cache=False, **settings))


def test_clustered_benchmark_selection_is_a_valid_selection_with_small_block_unions():
    from minimax_m3.bench_prefill import CLUSTER_PAGES, clustered_selection

    length, page = 6000, 128
    selection = clustered_selection(length, 4, 16, page, "cpu", torch.Generator().manual_seed(0))
    local = torch.arange(length) // page
    assert selection.shape == (length, 4, 16)
    assert bool((selection <= local[:, None, None]).all()) and bool((selection.max(-1).values == local[:, None]).all())
    ordered = selection.sort(-1).values
    assert bool(((ordered[..., 1:] != ordered[..., :-1]) | (ordered[..., 1:] < 0)).all())  # distinct pages
    for block in range(16, length // page):
        union = selection[block * page : (block + 1) * page, 2].unique()
        assert union.numel() <= CLUSTER_PAGES


def test_attention_benchmark_smoke_run(capsys):
    from minimax_m3 import bench_prefill

    bench_prefill.main(["--attention-only", "--lengths", "64", "--repeats", "1", "--selection", "clustered"])
    assert "| 64 | clustered |" in capsys.readouterr().out


def test_clustered_selections_replace_the_indexers_pages_but_still_run_it():
    from minimax_m3.bench_prefill import build, clustered_selection, clustered_selections, geometry_config

    config = geometry_config(2, tiny=True)  # pages of 16 tokens, top-4: 200 tokens are 13 pages
    model = build("sparse", config, torch.device("cpu"), torch.float32)
    selector = model.model.page_selector
    calls = []
    real_select = selector.select
    selector.select = lambda *args: calls.append(1) or real_select(*args)
    ids = torch.randint(3, 1000, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(ids, output_page_selections=True).page_selections
        with clustered_selections(selector, config, 200, "cpu", torch.Generator().manual_seed(1)):
            chunks = [model(ids[:, :120], use_cache=True, output_page_selections=True)]
            chunks.append(model(ids[:, 120:], past_key_values=chunks[0].past_key_values, use_cache=True,
                                output_page_selections=True))
        after = model(ids, output_page_selections=True).page_selections
    table = clustered_selection(200, config.num_key_value_heads, config.index_topk_blocks, config.index_block_size,
                                "cpu", torch.Generator().manual_seed(1))
    for layer in range(2):
        got = torch.cat([chunk.page_selections[layer][0] for chunk in chunks])
        assert torch.equal(got, table)
        assert not torch.equal(own[layer][0], table) and torch.equal(after[layer][0], own[layer][0])
    assert len(calls) == 2 * 4  # the indexer ran in both sparse layers of all four forwards


def test_clustered_selections_refuse_positions_beyond_their_table():
    from minimax_m3.bench_prefill import build, clustered_selections, geometry_config

    config = geometry_config(1, tiny=True)
    model = build("sparse", config, torch.device("cpu"), torch.float32)
    with clustered_selections(model.model.page_selector, config, 100, "cpu"), torch.no_grad():
        with pytest.raises(ValueError, match="drawn for 100 positions, a sequence reaches 120"):
            model(torch.randint(3, 1000, (1, 120)))


def test_page_selector_gives_the_indexer_host_lengths_for_batched_prefills_only():
    from minimax_m3.sparse_attention import ForwardMetadata, PageSelector

    def metadata(query_lengths, kv_lengths):
        return ForwardMetadata(torch.zeros(1), torch.zeros(1), query_lengths, kv_lengths, [0] * len(query_lengths))

    assert PageSelector._request_lengths(metadata([100, 30], [2000, 900])) == [(100, 2000), (30, 900)]
    assert PageSelector._request_lengths(metadata([100], [2000])) is None  # one request: the bounds are exact
    assert PageSelector._request_lengths(metadata([1, 1, 1], [900, 2000, 50])) is None  # decode: memoised bounds
