"""The compiled elementwise chains (``minimax_m3.fusion``): compiled per width, generic in the token count."""

import torch
from torch._dynamo.utils import counters

from minimax_m3.fusion import compiled
from minimax_m3.modeling_minimax_m3 import rms_norm, swiglu_oai


def test_a_chain_compiles_once_per_width_for_any_number_of_tokens_and_equals_the_eager_math():
    chain = compiled("test_fusion_rms_norm", rms_norm)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, generator=generator)
    graphs_before = counters["stats"]["unique_graphs"]
    for tokens in (37, 300, 5):
        x = torch.randn(tokens, 48, generator=generator)
        torch.testing.assert_close(chain(x, weight, 1e-6, 1.0), rms_norm(x, weight, 1e-6, 1.0))
    assert chain.signatures() == 1
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # the token count stayed generic

    wider, wider_weight = torch.randn(7, 64, generator=generator), torch.randn(64, generator=generator)
    torch.testing.assert_close(chain(wider, wider_weight, 1e-6, 0.0), rms_norm(wider, wider_weight, 1e-6, 0.0))
    assert chain.signatures() == 2


def test_a_strided_view_of_packed_rows_keeps_its_own_signature():
    """The experts' SwiGLU reads the gate and up halves of one ``[rows, 2I]`` tensor: strided views, specialised to
    their stride, and distinct from contiguous inputs of the same width."""
    chain = compiled("test_fusion_swiglu", swiglu_oai)
    generator = torch.Generator().manual_seed(1)
    for rows in (12, 40):
        gate_up = torch.randn(rows, 2 * 24, generator=generator) * 4
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(chain(gate, up, 1.702, 7.0, 1.0), swiglu_oai(gate, up, 1.702, 7.0, 1.0))
    assert chain.signatures() == 1
    gate, up = (torch.randn(9, 24, generator=generator) for _ in range(2))
    torch.testing.assert_close(chain(gate, up, 1.702, 7.0, 1.0), swiglu_oai(gate, up, 1.702, 7.0, 1.0))
    assert chain.signatures() == 2


def test_the_bench_times_every_chain_and_its_compiled_forms_equal_the_eager_math():
    from minimax_m3.bench_fusion import CHAINS, main

    rows = main(["--device", "cpu", "--tokens", "64", "--hidden", "128", "--intermediate", "64", "--repeats", "1"])
    assert [row["chain"] for row in rows] == list(CHAINS)
    for row in rows:
        assert row["ours_ms"] > 0 and row["dynamic_ms"] > 0 and row["eager_ms"] > 0
        assert row["ours_error"] < 0.3 and row["dynamic_error"] < 0.3  # bf16 rounding of values up to about 10


def test_a_model_with_every_chain_compiled_equals_eager_and_compiles_nothing_for_new_lengths(monkeypatch):
    """The chains the model compiles on CUDA, forced on here on the CPU: each call site's arguments make a signature
    (a length never does), and the logits equal the eager forward's."""
    import minimax_m3.experts as experts
    import minimax_m3.fusion as fusion
    import minimax_m3.modeling_minimax_m3 as modeling
    import minimax_m3.split_kv as split_kv
    from test_minimax_m3 import tiny_model

    model = tiny_model()
    prompts = {length: torch.randint(3, 90, (1, length), generator=torch.Generator().manual_seed(length))
               for length in (40, 77, 130)}
    with torch.no_grad():
        eager = {length: model(ids).logits for length, ids in prompts.items()}
        for module in (fusion, modeling, experts, split_kv):
            monkeypatch.setattr(module, "fuse", lambda x: not torch.is_grad_enabled())
        monkeypatch.setattr(fusion, "_compiled_functions", {})
        signatures = []
        for length, ids in prompts.items():
            torch.testing.assert_close(model(ids).logits, eager[length], atol=1e-5, rtol=1e-5)
            signatures.append({name: chain.signatures() for name, chain in fusion._compiled_functions.items()
                               if hasattr(chain, "signatures")})  # chains compiled per signature
    assert signatures[0] == signatures[1] == signatures[2]
    assert {"rms_norm", "add_and_norm", "swiglu_oai", "norm_rope_and_cast", "weighted_token_sum"} <= set(signatures[0])


def test_the_flash_decode_split_queries_compiled_equal_the_eager_ops():
    from minimax_m3.decode_attention import split_queries

    chain = compiled("test_fusion_split_queries", split_queries)
    generator = torch.Generator().manual_seed(2)
    split_start = torch.arange(4, dtype=torch.int32) * 100
    for batch in (1, 3):
        q = torch.randn(batch, 6, 8, generator=generator).to(torch.bfloat16)
        kv_lengths = torch.randint(0, 450, (batch,), generator=generator)
        query, used = chain(q, kv_lengths, split_start, 100)
        assert torch.equal(query, q.repeat_interleave(4, dim=0))
        assert used.dtype == torch.int32
        assert torch.equal(used, (kv_lengths[:, None] - split_start).clamp(0, 100).int())
