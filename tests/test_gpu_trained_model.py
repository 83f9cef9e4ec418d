"""The shipped trained tiny model and its evaluation on a CUDA device (run on the H200)."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import minimax_m3  # noqa: F401  (registers the Auto classes)
from eval import retrieval_accuracy as ra
from eval.synthetic_retrieval import RetrievalDataConfig, RetrievalDataGenerator
from eval.trained_model import trained_model_dir
from minimax_m3.sparse_attention import ForwardMetadata, sparse_attention_masked, sparse_attention_reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def trained():
    path = trained_model_dir()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    return model, AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_sparse_attention_matches_the_reference_on_cuda(dtype):
    torch.manual_seed(0)
    page, topk, heads, kv_heads, dim = 128, 16, 4, 2, 64
    query_lengths, kv_lengths = [700, 3000], [2700, 3000]
    keys = torch.randn(2, 3000, kv_heads, dim, device="cuda", dtype=dtype)
    values = torch.randn_like(keys)
    positions = torch.cat([torch.arange(kv - n, kv) for n, kv in zip(query_lengths, kv_lengths)]).cuda()
    batch_index = torch.cat([torch.full((n,), b) for b, n in enumerate(query_lengths)]).cuda()
    local = positions // page
    history = torch.rand(len(positions), kv_heads, 24, device="cuda").argsort(-1)[..., : topk - 1]  # pages < 24
    selection = torch.where(history < local[:, None, None], history, -1)
    selection = torch.cat([selection, local[:, None, None].expand(-1, kv_heads, 1)], -1).to(torch.int32)
    metadata = ForwardMetadata(batch_index, positions, query_lengths, kv_lengths, [0, 700])
    q = torch.randn(len(positions), heads, dim, device="cuda", dtype=dtype)
    expected = sparse_attention_reference(q, keys, values, selection, metadata, scale=0.125, page_size=page)
    got = sparse_attention_masked(q, keys, values, selection, metadata, scale=0.125, page_size=page)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_trained_model_reads_a_far_pass_key_through_its_indexer_on_cuda(trained):
    model, tokenizer = trained
    generator = RetrievalDataGenerator(tokenizer, RetrievalDataConfig(queries=1, max_pairs=1, min_answer_distance=6000,
                                                                      task_weights=(0, 1)))
    ids, [(_, needle, answer_start)] = generator.sample_document(random.Random(11), 8192)
    input_ids = torch.tensor([ids[:answer_start]], device="cuda")
    first_digit = ids[answer_start]
    answers = {}
    for selection_kind in ("indexer", "recent"):
        model.config.page_selection = selection_kind
        with torch.no_grad():
            output = model(input_ids, output_page_selections=True, logits_to_keep=1)
        selected = torch.stack([s[0, -1] for s in output.page_selections])  # [layers, groups, 16]
        answers[selection_kind] = (bool((selected == needle // 128).any()), int(output.logits[0, -1].argmax()))
    model.config.page_selection = "indexer"
    assert answers["indexer"] == (True, first_digit)  # the distilled indexer finds the page; the model answers
    assert answers["recent"][0] is False  # 6,000 tokens back: outside the 16 most recent pages


def test_retrieval_report_runs_on_cuda(trained):
    model, tokenizer = trained
    result = ra.evaluate_retrieval_accuracy(model, tokenizer, lengths=(4096,), documents=2, recall_documents=1,
                                            show_progress=False)
    by_variant = result["lengths"][4096]
    assert result["complete"] and set(by_variant) == set(ra.VARIANTS)
    assert by_variant["dense"]["by_task"]["passkey"]["accuracy"] == 1.0
    for name in ra.VARIANTS[1:]:
        assert [layer["layer"] for layer in by_variant[name]["recall"]] == [1, 2]
