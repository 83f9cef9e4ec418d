"""A Llama converted to MiniMax-M3 on a CUDA device (run on the H200): the converted SmolLM2's geometry (3 KV groups and
index heads of 64, pages of 128, top-16), whose indexer runs the torch backend, gives the CPU's logits and pages, and
its distillation step runs there."""

import copy

import pytest
import torch

from eval.real_model.distill import DistillationPlan, IndexerDistiller
from minimax_m3.from_llama import convert_llama
from selection_ties import selection_differences
from test_minimax_m3_from_llama import random_llama

pytestmark = pytest.mark.gpu

SMOLLM2_ATTENTION = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         intermediate_size=256, vocab_size=301, max_position_embeddings=8192)


WEIGHT_SCALE = 0.1
"""The projections of ``random_llama`` (std 0.2) scaled to std 0.02, a trained model's: at std 0.2 the 4 layers
amplify rounding so much that the CPU's own fp32 and fp64 logits differ by 0.085; at 0.02 by 5e-5 (logits up to
about 110), well inside the comparison's 1e-3."""


def well_conditioned_llama():
    llama = random_llama(**SMOLLM2_ATTENTION)
    with torch.no_grad():
        for name, parameter in llama.named_parameters():
            if not name.endswith("norm.weight") and "embed_tokens" not in name:
                parameter.mul_(WEIGHT_SCALE)
    return llama


@pytest.fixture(scope="module")
def converted():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    return convert_llama(well_conditioned_llama(), first_sparse_layer=1, index_head_dim=64,
                         index_block_size=128, index_topk_blocks=16, index_dtype="float32")


IDS = torch.randint(3, 301, (1, 2600), generator=torch.Generator().manual_seed(0))  # 21 pages: some dropped


@pytest.fixture(scope="module")
def cpu_forward(converted):
    with torch.no_grad():
        return converted(IDS, output_page_selections=True)


@pytest.mark.parametrize("implementation", ["reference", "flex", "masked"])
def test_the_converted_geometry_on_cuda_gives_the_cpu_logits_and_pages(converted, cpu_forward, implementation):
    expected = cpu_forward
    model = copy.deepcopy(converted).cuda()
    model.config.sparse_attention_implementation = implementation
    with torch.no_grad():
        got = model(IDS.cuda(), output_page_selections=True)
    assert model.model.page_selector.indexer_backends() == {"torch"}
    differences = selection_differences(converted, IDS, torch.ones_like(IDS), got.page_selections,
                                        expected.page_selections)
    assert differences["not_ties"] == 0, differences
    # a row whose pages differ in one layer changes that row's keys and values in every later layer, so every
    # later row too: the logits are compared on the rows before the first such row (fp32 on both devices; the
    # tolerance covers the devices' different summation orders over 4 layers: see WEIGHT_SCALE)
    first = differences["first_different"][0]
    first = IDS.shape[1] if first is None else first
    assert first >= 2048  # below, every row reads every page: nothing can differ
    torch.testing.assert_close(got.logits[:, :first].cpu(), expected.logits[:, :first], atol=1e-3, rtol=1e-4)


def test_a_distillation_step_at_4k_runs_on_cuda_and_lowers_the_kl(converted, tmp_path):
    model = convert_llama(random_llama(**SMOLLM2_ATTENTION), first_sparse_layer=1, index_head_dim=64).cuda()
    windows = [torch.randint(3, 301, (4096,), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    plan = DistillationPlan(steps=8, learning_rate=2e-2, warmup_steps=1, checkpoint_every=4)
    record = IndexerDistiller(model, windows, windows[:1], plan=plan, output=tmp_path, device="cuda").run()
    assert record["complete"]
    assert record["held_out_kl_after"]["mean"] < record["held_out_kl_before"]["mean"]
