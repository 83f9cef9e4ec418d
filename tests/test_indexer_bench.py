"""``python -m indexer.bench``'s command line and summary on a CPU machine (the timing itself needs the GPU)."""

import pytest

from indexer import bench, cute_backend


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


@pytest.mark.parametrize("value, expected", [("none", None), ("4", 4)])
def test_topk_lane_list_option_selects_the_kernel_variant(value, expected, monkeypatch):
    monkeypatch.setattr(cute_backend, "TOPK_LANE_LIST_LENGTH", 4)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick", "--topk-lane-list", value])
    assert cute_backend.TOPK_LANE_LIST_LENGTH == expected


def test_issue_ring_option_switches_the_score_kernel_schedule(monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    for value, expected in (("progress", "progress"), ("commit", "commit"), ("none", None)):
        monkeypatch.setattr(cute_backend, "SCORE_ISSUE_RING", "unset")
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--quick", "--issue-ring", value])
        assert cute_backend.SCORE_ISSUE_RING == expected


def test_task_cost_option_switches_the_planner_model(monkeypatch):
    from indexer import planner

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    for value in ("tile", "rows"):
        monkeypatch.setattr(planner, "DEFAULT_TASK_COST", "unset")
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--quick", "--task-cost", value])
        assert planner.DEFAULT_TASK_COST == value


def test_task_order_option_switches_the_planner_layout(monkeypatch):
    from indexer import planner

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    for value in ("snake", "buckets"):
        monkeypatch.setattr(planner, "DEFAULT_TASK_ORDER", "unset")
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--quick", "--task-order", value])
        assert planner.DEFAULT_TASK_ORDER == value


def test_tma_stores_option_switches_the_score_kernel_variant(monkeypatch):
    from indexer import cute_backend

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    for value, expected in (("off", False), ("on", True)):
        monkeypatch.setattr(cute_backend, "SCORE_TMA_STORES", "unset")
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main(["--quick", "--tma-stores", value])
        assert cute_backend.SCORE_TMA_STORES is expected
