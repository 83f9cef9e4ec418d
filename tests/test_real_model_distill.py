"""eval.real_model's indexer distillation on a tiny converted Llama: it lowers the KL, trains only the indexer,
resumes to the same result, refuses other settings, and exports exactly the indexer."""

import json

import pytest
import torch

from eval.real_model.corpus import with_repeated_spans
from eval.real_model.distill import (INDEXER_FILE, RECORD_FILE, DistillationPlan, IndexerDistiller, held_out_kl,
                                     load_indexer)
from minimax_m3.from_llama import INDEXER_SUFFIXES, convert_llama
from test_minimax_m3_from_llama import random_llama

CONVERSION = dict(first_sparse_layer=1, index_block_size=4, index_topk_blocks=3)


def converted(seed=0):
    return convert_llama(random_llama(), seed=seed, **CONVERSION)


def windows(count, length=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 101, (length,), generator=generator) for _ in range(count)]


def distiller(tmp_path, model=None, steps=12, **kwargs):
    plan = DistillationPlan(steps=steps, learning_rate=2e-2, warmup_steps=2, checkpoint_every=4)
    train = windows(3)
    return IndexerDistiller(model or converted(), train, train[:2], plan=plan, output=tmp_path, device="cpu", **kwargs)


def test_distillation_lowers_the_kl_and_trains_only_the_indexer(tmp_path):
    run = distiller(tmp_path)
    before = {name: tensor.clone() for name, tensor in run.model.state_dict().items()}
    record = run.run()
    assert record["complete"] and record["steps_done"] == 12
    assert record["held_out_kl_after"]["mean"] < 0.8 * record["held_out_kl_before"]["mean"]
    assert set(record["held_out_kl_after"]["per_layer"]) == {1, 2, 3}
    for name, tensor in run.model.state_dict().items():
        assert torch.equal(tensor, before[name]) != name.endswith(INDEXER_SUFFIXES), name
    saved = json.loads((tmp_path / RECORD_FILE).read_text())
    assert saved["held_out_kl_after"]["mean"] == pytest.approx(record["held_out_kl_after"]["mean"])
    fresh = converted()
    load_indexer(fresh, tmp_path / INDEXER_FILE)
    assert held_out_kl(fresh, windows(3)[:2], "cpu")["mean"] == pytest.approx(record["held_out_kl_after"]["mean"])


def test_the_history_objective_lowers_its_kl_and_records_the_page_kl_beside_it(tmp_path):
    record = distiller(tmp_path).run()
    assert record["complete"] and record["settings"]["objective"] == "history"
    before, after = record["held_out_kl_before"], record["held_out_kl_after"]
    assert after["objective"]["mean"] < 0.8 * before["objective"]["mean"]
    assert after["mean"] < before["mean"]  # the page KL, comparable with the "pages" objective's runs
    fresh = converted()
    load_indexer(fresh, tmp_path / INDEXER_FILE)
    assert held_out_kl(fresh, windows(3)[:2], "cpu", "history")["mean"] == pytest.approx(after["objective"]["mean"])


@pytest.mark.parametrize("index_head_dim", [8, 12])
def test_the_indexer_starts_as_its_attention_group_means(tmp_path, index_head_dim):
    model = convert_llama(random_llama(), index_head_dim=index_head_dim, **CONVERSION)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items() if ".index_" in name}
    run = distiller(tmp_path, model=model)
    config = model.config
    groups, head_dim = config.num_key_value_heads, config.head_dim
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(3))
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        if not attention.is_sparse:
            continue
        with torch.no_grad():
            queries = (x @ attention.q_proj.weight.T).view(5, groups, -1, head_dim)
            keys = (x @ attention.k_proj.weight.T).view(5, groups, head_dim)
            index_q, index_k = (projection.detach() for projection in attention._projected_index_query_key(x))
        index_q = index_q.view(5, groups, index_head_dim)
        torch.testing.assert_close(index_q[..., :head_dim], queries.mean(2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(index_k[..., :head_dim], keys.mean(1), atol=1e-5, rtol=1e-5)
        # a wider index head's position-free dimensions keep the converted model's projection
        prefix = f"model.layers.{index}.self_attn."
        q_before = before[prefix + "index_q_proj.weight"].view(groups, index_head_dim, -1)[:, head_dim:]
        torch.testing.assert_close(attention.index_q_proj.weight.view(groups, index_head_dim, -1)[:, head_dim:],
                                   q_before, atol=0, rtol=0)
        torch.testing.assert_close(attention.index_k_proj.weight[head_dim:],
                                   before[prefix + "index_k_proj.weight"][head_dim:], atol=0, rtol=0)
        for norm in (attention.index_q_norm, attention.index_k_norm):
            assert torch.all(norm.weight + norm.offset == 1)
    record = run.run()
    assert record["complete"] and record["settings"]["indexer_start"] == "attention"
    assert record["held_out_kl_after"]["mean"] < record["held_out_kl_before"]["mean"]
    # a resumed run keeps its trained indexer instead of starting from attention again
    trained = {name: tensor.clone() for name, tensor in model.state_dict().items() if ".index_" in name}
    again = convert_llama(random_llama(), index_head_dim=index_head_dim, **CONVERSION)
    distiller(tmp_path, model=again)
    for name, tensor in trained.items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_the_state_of_a_run_from_the_random_indexer_is_not_continued(tmp_path):
    distiller(tmp_path).run(max_seconds=0)
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    del state["settings"]["indexer_start"]  # what runs from the converted model's random indexer wrote
    torch.save(state, tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"other settings \(indexer_start\)"):
        distiller(tmp_path)


@pytest.mark.parametrize("field, value", [("index_n_heads", 1), ("index_head_dim", 4)])
def test_the_attention_start_needs_an_index_head_per_group_of_the_head_size(tmp_path, field, value):
    model = converted()  # the conversion refuses such geometries itself; a model from elsewhere may have them
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match="one index head per KV group"):
        distiller(tmp_path, model=model)
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path):
    whole = distiller(tmp_path / "whole")
    whole.run()
    first = distiller(tmp_path / "parts")
    partial = first.run(max_seconds=0)  # stops after its first step, with the state saved
    assert not partial["complete"] and partial["steps_done"] == 1 and not (tmp_path / "parts" / INDEXER_FILE).exists()
    resumed = distiller(tmp_path / "parts")
    assert resumed.step == 1
    resumed.run()
    for name, tensor in whole.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, atol=1e-6, rtol=1e-5)


def test_the_state_of_a_run_by_the_page_objective_is_not_continued(tmp_path):
    distiller(tmp_path).run(max_seconds=0)
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    del state["settings"]["objective"]  # what runs by the KL over every causal page wrote
    torch.save(state, tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"other settings \(objective\)"):
        distiller(tmp_path)


def test_the_state_of_a_run_without_repeated_spans_is_not_continued(tmp_path):
    distiller(tmp_path).run(max_seconds=0)
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    del state["settings"]["plan"]["repeated_spans"]  # what runs on the novels' windows as written wrote
    torch.save(state, tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"other settings \(plan.repeated_spans\)"):
        distiller(tmp_path)


def test_a_state_of_other_settings_is_refused(tmp_path):
    distiller(tmp_path).run(max_seconds=0)
    plan = DistillationPlan(steps=12, learning_rate=1e-3, warmup_steps=2, checkpoint_every=4)
    with pytest.raises(ValueError, match=r"other settings \(plan.learning_rate\)"):
        IndexerDistiller(converted(), windows(3), windows(3)[:2], plan=plan, output=tmp_path, device="cpu")
    with pytest.raises(ValueError, match="holds a run"):
        distiller(tmp_path, resume=False)


def test_an_indexer_file_of_another_model_is_refused_before_copying(tmp_path):
    distiller(tmp_path, steps=1).run()
    other = convert_llama(random_llama(), **{**CONVERSION, "first_sparse_layer": 2})
    before = other.state_dict()["model.layers.2.self_attn.index_q_proj.weight"].clone()
    with pytest.raises(ValueError, match="is not this model's indexer"):
        load_indexer(other, tmp_path / INDEXER_FILE)
    assert torch.equal(other.state_dict()["model.layers.2.self_attn.index_q_proj.weight"], before)
    with pytest.raises(ValueError, match="do not exist"):
        load_indexer(other, tmp_path / "none.safetensors")


def test_repeated_spans_copy_the_windows_own_tokens_at_least_the_distance_later():
    window = torch.arange(1000, 1300)
    generator = torch.Generator().manual_seed(7)
    out = with_repeated_spans(window, generator, spans=3, span_tokens=(5, 9), min_distance=100)
    assert torch.equal(window, torch.arange(1000, 1300))  # the input is left as it was
    changed = (out != window).nonzero().flatten().tolist()
    assert changed
    runs, start = [], changed[0]  # maximal runs of overwritten positions: each holds copies of earlier tokens
    for previous, position in zip(changed, changed[1:] + [None]):
        if position != previous + 1:
            runs.append((start, previous + 1))
            start = position
    for begin, _ in runs:
        source = int(out[begin]) - 1000  # the window's tokens are their own positions (plus 1000) until copied over
        assert begin - source >= 100 + 1, (begin, source)
    again = with_repeated_spans(window, torch.Generator().manual_seed(7), spans=3, span_tokens=(5, 9),
                                min_distance=100)
    assert torch.equal(out, again)
    short = torch.arange(50)
    assert torch.equal(with_repeated_spans(short, generator, spans=3, span_tokens=(5, 9), min_distance=100), short)
    with pytest.raises(ValueError, match="span_tokens"):
        with_repeated_spans(window, generator, spans=1, span_tokens=(9, 5))


def test_the_distiller_trains_on_windows_with_repeated_spans_drawn_from_the_step(tmp_path, monkeypatch):
    seen = []
    run = distiller(tmp_path, steps=3)
    original = run.model.model.forward

    def recording(*args, input_ids=None, **kwargs):
        seen.append(input_ids.clone())
        return original(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(run.model.model, "forward", recording)
    run.run()
    trained = [ids[0] for ids in seen[4:7]]  # after the held-out KL of two windows, by both objectives
    plain = [run.train_windows[index] for index in run.order[:3]]
    assert all(not torch.equal(ids, window) for ids, window in zip(trained, plain))
    assert all(int((ids != window).sum()) <= 8 for ids, window in zip(trained, plain))  # 8 spans of one token


@pytest.mark.parametrize("overrides, text", [(dict(steps=0), "steps must be an int >= 1"),
                                             (dict(learning_rate=float("nan")), "learning_rate must be a finite"),
                                             (dict(warmup_steps=-1), "warmup_steps must be an int >= 0"),
                                             (dict(repeated_spans=-1), "repeated_spans must be an int >= 0")])
def test_a_bad_plan_raises(overrides, text):
    with pytest.raises(ValueError, match=text):
        DistillationPlan(**overrides)
