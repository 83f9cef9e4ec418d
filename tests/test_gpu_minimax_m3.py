"""minimax_m3 on a CUDA device (run on the H200)."""

import copy

import pytest
import torch

from test_minimax_m3 import tiny_model

pytestmark = pytest.mark.gpu

M3_INDEX_GEOMETRY = dict(
    head_dim=128,
    rotary_dim=64,
    sparse_attention_config={"sparse_attention_freq": [0, 1, 1], "sparse_num_index_heads": 2, "sparse_index_dim": 128,
                             "sparse_block_size": 128, "sparse_topk_blocks": 16, "sparse_init_block": 0,
                             "sparse_local_block": 1},
)
"""Index head dim 128, pages of 128, top-16 (the kernels' geometry) on the tiny model."""


def test_cuda_logits_match_cpu():
    model = tiny_model()
    ids = torch.randint(3, 97, (2, 45))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    expected = model(ids, attention_mask=mask, output_page_selections=True)
    cuda_model = tiny_model().cuda()
    got = cuda_model(ids.cuda(), attention_mask=mask.cuda(), output_page_selections=True)
    torch.testing.assert_close(got.logits.cpu(), expected.logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(got.page_selections, expected.page_selections):
        assert torch.equal(a.cpu(), b)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs SM90")
def test_real_index_geometry_runs_the_sm90_kernel():
    """Index head dim 128, pages of 128, top-16: the sparse layers are served by the CuTe kernels."""
    model = tiny_model(index_dtype="float8_e4m3fn", **M3_INDEX_GEOMETRY).cuda()
    ids = torch.randint(3, 97, (1, 2600), device="cuda")
    out = model(ids, output_page_selections=True, logits_to_keep=1)
    assert torch.isfinite(out.logits).all()
    wrapper = next(iter(model.model.page_selector._wrappers.values()))
    assert wrapper.active_backend == "cute"
    selection = out.page_selections[0][0]  # [T, G, 16]
    positions = torch.arange(2600, device="cuda")
    # every row's largest selected page is its local page (the forced one)
    assert torch.equal(selection.max(dim=2).values, (positions // 128)[:, None].expand(-1, 2).int())


def test_flex_sparse_attention_on_cuda_matches_the_reference():
    """Compiled FlexAttention (packed GQA, page bit-set mask) == the exact reference, with the real 128-token pages
    (FlexAttention's GPU tiles need KV blocks of at least their size). Passed on the H200 (2026-11-30)."""
    reference = tiny_model(index_dtype="float32", **M3_INDEX_GEOMETRY).cuda()
    flex = tiny_model(index_dtype="float32", sparse_attention_implementation="flex", **M3_INDEX_GEOMETRY).cuda()
    ids = torch.randint(3, 97, (1, 2600), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(flex(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_give_the_logits_of_one(tmp_path):
    """accelerate device_map over 2 GPUs (layers split, per-device indexer plans and score buffers) = one GPU."""
    from minimax_m3 import MiniMaxM3ForCausalLM

    tiny_model(index_dtype="float8_e4m3fn", **M3_INDEX_GEOMETRY).save_pretrained(tmp_path)
    ids = torch.randint(3, 97, (2, 2600))
    mask = torch.ones_like(ids)
    mask[1, :300] = 0
    one = MiniMaxM3ForCausalLM.from_pretrained(tmp_path, device_map={"": 0}, dtype=torch.float32)
    split = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
             "model.layers.2": 1, "model.norm": 1, "lm_head": 1}
    two = MiniMaxM3ForCausalLM.from_pretrained(tmp_path, device_map=split, dtype=torch.float32)
    assert {p.device.index for p in two.parameters()} == {0, 1}
    with torch.no_grad():
        expected = one(ids.cuda(0), attention_mask=mask.cuda(0), output_page_selections=True)
        got = two(ids.cuda(0), attention_mask=mask.cuda(0), output_page_selections=True)
    torch.testing.assert_close(got.logits.to("cuda:0"), expected.logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(got.page_selections, expected.page_selections):
        assert torch.equal(a.to("cuda:0")[mask.bool().cuda()], b[mask.bool().cuda()])


def test_compiled_norm_and_rope_matches_eager():
    from minimax_m3.modeling_minimax_m3 import MiniMaxM3RMSNorm, apply_partial_rope, norm_and_rope, rms_norm

    norm = MiniMaxM3RMSNorm(128, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_(std=0.1)
        x = torch.randn(3001, 16, 128, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(3001, 32, device="cuda") * 100
        cos, sin = angles.cos(), angles.sin()
        fused = norm_and_rope(norm, x, cos, sin)
        eager = apply_partial_rope(rms_norm(x, norm.weight, norm.eps), cos, sin)
    assert fused.dtype == eager.dtype == torch.bfloat16
    # the same math; the fused reduction may round one bf16 ulp differently
    torch.testing.assert_close(fused, eager, atol=2e-2, rtol=1e-2)


def test_compiled_norm_and_swiglu_match_eager():
    """Inference on CUDA runs the model's elementwise chains compiled; each must be the eager function's math."""
    from minimax_m3.modeling_minimax_m3 import (MiniMaxM3RMSNorm, apply_partial_rope, gated_activation, rms_norm, rope,
                                                 swiglu_oai)

    config = tiny_model().config
    generator = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4099, 768, device="cuda", dtype=torch.bfloat16, generator=generator)
    norm = MiniMaxM3RMSNorm(768, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_(std=0.1, generator=generator)
        torch.testing.assert_close(norm(x), rms_norm(x, norm.weight, norm.eps), atol=2e-2, rtol=1e-2)
        gate, up = 4 * x, 4 * x.flip(0)  # reach the clamps
        expected = swiglu_oai(gate, up, config.swiglu_alpha, config.swiglu_limit, config.swiglu_beta)
        # eager rounds every op to bf16, the compiled kernel computes in fp32 and rounds once
        torch.testing.assert_close(gated_activation(config, gate, up), expected, atol=2e-2, rtol=2e-2)
        # the converted models' options: the standard norm, the plain SiLU-gated MLP and RoPE without a norm
        standard = MiniMaxM3RMSNorm(768, 1e-5, gemma=False).cuda()
        standard.weight.normal_(mean=1.0, std=0.1, generator=generator)
        torch.testing.assert_close(standard(x), rms_norm(x, standard.weight, 1e-5, 0.0), atol=2e-2, rtol=1e-2)
        plain = copy.deepcopy(config)
        plain.hidden_act = "silu_and_mul"
        torch.testing.assert_close(gated_activation(plain, gate, up), torch.nn.functional.silu(gate) * up,
                                   atol=2e-2, rtol=2e-2)
        heads = x.view(4099, 12, 64)
        angles = torch.rand(4099, 32, device="cuda", generator=generator) * 100
        torch.testing.assert_close(rope(heads, angles.cos(), angles.sin()),
                                   apply_partial_rope(heads, angles.cos(), angles.sin()), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("experts_implementation", ["grouped_mm", "batched_mm"])
def test_experts_implementations_on_cuda_match_the_eager_loop(experts_implementation):
    """transformers' grouped / batched experts kernels on the model's packed experts (64 experts, 4 per token, the
    compiled SwiGLU-OAI gate) against the eager per-expert loop, on the same routing: equal in fp32, and in bf16 as
    close as bf16 rounding allows."""
    from minimax_m3.modeling_minimax_m3 import MiniMaxM3SparseMoeBlock

    config = tiny_model(hidden_size=256, intermediate_size=128, num_local_experts=64, num_experts_per_tok=4).config
    torch.manual_seed(5)
    block = MiniMaxM3SparseMoeBlock(config).cuda()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(std=0.1)
        x = torch.randn(3001, 256, device="cuda")
        chosen, weights, _ = block.route(x)
        config._experts_implementation = "eager"
        expected = block.experts(x, chosen, weights)
        config._experts_implementation = experts_implementation
        torch.testing.assert_close(block.experts(x, chosen, weights), expected, atol=1e-4, rtol=1e-4)
        experts = block.experts.to(torch.bfloat16)
        output = experts(x.to(torch.bfloat16), chosen, weights)
    assert output.dtype == torch.bfloat16
    error = (output.float() - expected).abs().max() / expected.abs().max()
    assert error < 2e-2, error


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9), reason="needs SM90")
def test_bf16_model_on_the_sm90_attention_kernel_is_as_close_to_fp32_as_the_bf16_reference():
    """M3's attention geometry per KV group (16 query heads of 128, pages of 128, top-16), 2,600 tokens (pages really
    dropped). In bf16 the model's 'auto' attention (the CuTe kernel) must be as close to the fp32 model as the bf16
    model with the exact reference attention is (random MoE routing amplifies any bf16 rounding, so the bound is
    relative to that noise, not absolute)."""
    geometry = dict(M3_INDEX_GEOMETRY, hidden_size=256, num_attention_heads=32, num_key_value_heads=2)
    fp32 = tiny_model(sparse_attention_implementation="reference", **geometry).cuda()
    cute = tiny_model(**geometry).to(device="cuda", dtype=torch.bfloat16)
    reference = tiny_model(sparse_attention_implementation="reference", **geometry).to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(3, 97, (1, 2600), device="cuda")
    with torch.no_grad():
        truth = fp32(ids).logits.float()
        got = cute(ids, output_page_selections=True)
        expected = reference(ids, output_page_selections=True)
    assert torch.equal(got.page_selections[0], expected.page_selections[0])  # layer 0 is dense: same inputs
    cute_error = (got.logits.float() - truth).abs()
    reference_error = (expected.logits.float() - truth).abs()
    assert cute_error.mean() <= 1.5 * reference_error.mean() + 1e-3, (cute_error.mean(), reference_error.mean())
    assert cute_error.max() <= 2 * reference_error.max() + 1e-2, (cute_error.max(), reference_error.max())


def test_dense_attention_over_a_cached_prefix_on_cuda_matches_the_masked_cpu_path():
    """The CUDA path (bottom-right causal bias, flash) == the CPU path (explicit masks in query chunks)."""
    from minimax_m3.dense_attention import dense_attention
    from minimax_m3.sparse_attention import ForwardMetadata

    generator = torch.Generator().manual_seed(0)
    query_lengths, kv_lengths = [300, 7], [1200, 1000]
    q = torch.randn(sum(query_lengths), 16, 128, generator=generator).to(torch.bfloat16)
    keys = torch.randn(2, 1280, 2, 128, generator=generator).to(torch.bfloat16)
    values = torch.randn(2, 1280, 2, 128, generator=generator).to(torch.bfloat16)
    positions = torch.cat([torch.arange(kv - n, kv) for n, kv in zip(query_lengths, kv_lengths)])
    batch_index = torch.cat([torch.full((n,), b) for b, n in enumerate(query_lengths)])

    def metadata(device):
        return ForwardMetadata(batch_index.to(device), positions.to(device), query_lengths, kv_lengths, [0, 300])

    expected = dense_attention(q.float(), keys.float(), values.float(), metadata("cpu"), scale=128 ** -0.5)
    got = dense_attention(q.cuda(), keys.cuda(), values.cuda(), metadata("cuda"), scale=128 ** -0.5)
    torch.testing.assert_close(got.float().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_cpu_offload_onto_cuda_gives_the_cuda_logits():
    """accelerate's cpu_offload (weights on the CPU, each module's moved to the GPU by its hook for its forward)
    through the fused CUDA paths, which read their weights inside the modules' forwards."""
    from accelerate import cpu_offload

    reference = tiny_model(**M3_INDEX_GEOMETRY).cuda()
    offloaded = tiny_model(**M3_INDEX_GEOMETRY)
    cpu_offload(offloaded, execution_device="cuda")
    ids = torch.randint(3, 97, (2, 300), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
