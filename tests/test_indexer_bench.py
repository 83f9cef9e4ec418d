"""``python -m indexer.bench``'s command line and summary on a CPU machine (the timing itself needs the GPU)."""

import pytest

from indexer import bench, cute_backend, planner


def result(num_heads, total_q, run_us, weight=0):
    return dict(case_id=f"prefill_{total_q:012d}", batch=1, total_q=total_q, max_kv=total_q + 4096, weight=weight,
                num_heads=num_heads, tasks=10, sm_busy=0.5 + total_q / 100000, scores_ms=run_us * 0.9e-3,
                topk_ms=run_us * 0.1e-3, run_ms=run_us * 1e-3, useful_flops=10**9, tflops_scores=1000.0)


def test_summary_reports_weighted_means_and_the_query_length_classes(capsys):
    results = [result(4, 100, 10.0, weight=3), result(4, 300, 30.0), result(4, 1000, 50.0, weight=1),
               result(4, 8192, 400.0), result(4, 16384, 800.0)]
    bench.print_summary(results)
    out = capsys.readouterr().out
    assert "H=4: weighted mean scores 18.0 us, top-k 2.0 us, run 20.0 us" in out  # (3 * 10 + 50) / 4
    assert "H=4 short (< 512 q): 2 cases, median run 20.0 us" in out
    assert "H=4 medium (512-4095 q): 1 cases, median run 50.0 us" in out
    assert "H=4 long (>= 4096 q): 2 cases, median run 600.0 us" in out


def test_classes_split_at_512_and_4096_query_tokens():
    classes = bench.query_length_classes([result(1, q, 1.0) for q in (511, 512, 4095, 4096)])
    assert [[r["total_q"] for r in rows] for rows in classes.values()] == [[511], [512, 4095], [4096]]


SETTINGS = {
    "--issue-ring": (cute_backend, "SCORE_ISSUE_RING", {"progress": "progress", "commit": "commit", "none": None}),
    "--tma-stores": (cute_backend, "SCORE_TMA_STORES", {"off": False, "on": True}),
    "--programmatic-topk": (cute_backend, "PROGRAMMATIC_TOPK", {"off": False, "on": True}),
    "--topk-row-split-max-rows": (cute_backend, "TOPK_ROW_SPLIT_MAX_ROWS", {"0": 0, "4096": 4096}),
    "--integer-row-max": (cute_backend, "SCORE_INTEGER_ROW_MAX", {"off": False, "on": True}),
    "--skip-idle-warpgroups": (cute_backend, "SCORE_SKIP_IDLE_WARPGROUPS", {"off": False, "on": True}),
    "--task-cost": (planner, "DEFAULT_TASK_COST", {"tile": "tile", "rows": "rows", "warpgroup": "warpgroup"}),
    "--task-order": (planner, "DEFAULT_TASK_ORDER", {"snake": "snake", "buckets": "buckets"}),
    "--chunk-policy": (planner, "DEFAULT_CHUNK_POLICY", {"fill_sms": "fill_sms", "balanced": "balanced"}),
    "--tile-rows": (cute_backend, "SCORE_TILE_ROWS", {"128": 128, "256": 256}),
}


@pytest.mark.parametrize("option, value", [(option, value) for option, (_, _, values) in SETTINGS.items() for value in values])
def test_each_option_sets_the_library_default_it_names(option, value, monkeypatch):
    """The bench's A/B switches set the library's module-level defaults before any plan or kernel is built."""
    module, name, values = SETTINGS[option]
    monkeypatch.setattr(module, name, "unset")
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick", option, value])
    assert getattr(module, name) == values[value] and type(getattr(module, name)) is type(values[value])


@pytest.mark.parametrize("text, name, value", [("rest_batch=1", "rest_batch", 1), ("lane_list_length=none", "lane_list_length", None),
                                               ("winners_in_shared=off", "winners_in_shared", False),
                                               ("heads_in_registers=on", "heads_in_registers", True)])
def test_topk_option_sets_one_kernel_option(text, name, value, monkeypatch):
    options = dict(cute_backend.TOPK_KERNEL_OPTIONS)
    monkeypatch.setattr(cute_backend, "TOPK_KERNEL_OPTIONS", options)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick", "--topk-option", text, "--topk-option", "saturating_u16_levels=off"])
    assert options[name] is value or options[name] == value and type(options[name]) is type(value)
    assert options["saturating_u16_levels"] is False


@pytest.mark.parametrize("text", ["rest_batch", "no_such_option=1", "rest_batch=fast"])
def test_topk_option_rejects_unknown_names_and_values(text, monkeypatch, capsys):
    monkeypatch.setattr(cute_backend, "TOPK_KERNEL_OPTIONS", dict(cute_backend.TOPK_KERNEL_OPTIONS))
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--topk-option", text])
    assert "--topk-option" in capsys.readouterr().err
