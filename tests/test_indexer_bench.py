"""``python -m indexer.bench``'s command line and summary on a CPU machine (the timing itself needs the GPU)."""

import pytest

from indexer import bench


def result(num_heads, total_q, run_us, weight=0):
    return dict(case_id=f"prefill_{total_q:012d}", batch=1, total_q=total_q, max_kv=total_q + 4096, weight=weight,
                num_heads=num_heads, tasks=10, sm_busy=0.5 + total_q / 100000, scores_ms=run_us * 0.9e-3,
                topk_ms=run_us * 0.1e-3, run_ms=run_us * 1e-3, useful_flops=10**9, tflops_scores=1000.0,
                eager_run_ms=run_us * 1.05e-3, eager_cold_run_ms=run_us * 1.2e-3, host_run_us=20.0, host_run_scores_us=10.0, host_plan_us=40.0,
                sm_busy_tile_time=0.9)


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


def test_summary_reports_the_eager_columns(capsys):
    rows = [dict(result(4, 100, 10.0, weight=1), eager_run_ms=12e-3), result(4, 8192, 400.0)]
    bench.print_summary(rows)
    out = capsys.readouterr().out
    assert "| 4 | 00000100 | 1 | 100 | 4196 | 10 | 0.50 | 9.0 | 1.0 | 10.0 | 12.0 | 1.20 | 12.0 | 20.0 / 10.0 / 40.0 |" in out
    assert "H=4 eager: weighted mean run 12.0 us (1.20x the graph replay)" in out
    assert "H=4 eager / graph over the 1 cases of >= 0.2 ms: max 1.050" in out


def test_the_command_line_keeps_what_users_need(monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick", "--heads", "1,4", "--case", "8192,32768", "--precision", "fp8", "--host-lengths",
                    "--output", "x.json"])
    for removed in ("--issue-ring", "--tile-rows", "--topk-option", "--task-cost", "--chunk-policy"):
        with pytest.raises(SystemExit):
            bench.main(["--quick", removed, "1"])
        assert "unrecognized arguments" in capsys.readouterr().err


def test_results_are_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "out" / "bench.json"
    bench.write_json_atomically(path, [1, 2])
    assert path.read_text().replace("\n", "").replace(" ", "") == "[1,2]"

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.json, "dump", crash)
    with pytest.raises(KeyboardInterrupt):
        bench.write_json_atomically(path, [3])
    assert path.read_text().replace("\n", "").replace(" ", "") == "[1,2]"
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"], "no temporary file is left behind"


def test_custom_cases_take_a_batch_of_equal_requests(monkeypatch, capsys):
    case = bench.custom_case(1, 131072, 16)
    assert case["case_id"] == "custom_1_131072_x16" and case["total_q"] == 16
    assert bench.sequence_lengths(case) == [(1, 131072)] * 16
    assert bench.sequence_lengths(bench.custom_case(8192, 32768)) == [(8192, 32768)]
    for spec in ("1,2,3,4", "a,b", "5,4", "1,8,0"):
        with pytest.raises(SystemExit):
            bench.main(["--only-custom", "--case", spec])
        assert "--case" in capsys.readouterr().err
