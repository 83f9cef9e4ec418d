"""eval.throughput on CPU with tiny models and short lengths: the JSON schema, the table, the plot, OOM as OOM,
noisy timings flagged, the no-CUDA fallback, a checkpoint through --model, and the main job (python -m eval) end to
end."""

import json
import logging

import pytest
import torch

import eval.__main__ as eval_main
from eval import default_model, throughput
from eval_isolation import isolate, no_network
from minimax_m3 import MiniMaxM3ForCausalLM

SHORT_RUN = ["--lengths", "96,160", "--chunked-context", "160", "--chunk-size", "64", "--seeds", "0,1",
             "--attention-lengths", "96", "--attention-repeats", "1", "--decode-contexts", "96", "--decode-steps", "2",
             "--turns-prefix", "96", "--turn-tokens", "16", "--turns", "2"]
RESULT_KEYS = {"mode", "workload", "length", "batch_size", "chunk_size", "tokens", "status", "speedup_vs_dense"}


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    return tmp_path


def test_throughput_command_end_to_end(isolated, capsys):
    output = isolated / "out" / "throughput.json"
    result = throughput.run_command(["--preset", "tiny", *SHORT_RUN, "--output", str(output)])

    saved = json.loads(output.read_text())
    assert saved["kind"] == "throughput" and saved["model"] == "preset tiny" and saved["dtype"] == "float32"
    assert saved["modes"] == ["sparse", "sparse-torch", "dense", "native"] and saved["seeds"] == [0, 1]
    assert saved["config"]["index_block_size"] == 16 and saved["config"]["num_hidden_layers"] == 4
    rows = [r for r in saved["results"] if r["workload"] in ("fresh", "chunked")]
    assert len(rows) == 4 * 3  # modes x (two fresh lengths + one chunked prefill)
    turns = [r for r in saved["results"] if r["workload"] == "turns"]
    assert [r["mode"] for r in turns] == ["sparse", "sparse-torch", "dense", "native"]
    for row in turns:
        assert row["status"] == "ok" and row["length"] == 96 and row["chunk_size"] == 16 and row["steps"] == 2
        assert row["tokens_per_second"]["max"] == pytest.approx(16 / row["seconds"]["min"])
    decoded = [r for r in saved["results"] if r["workload"] == "decode"]
    assert len(decoded) == 4 * 2  # modes x (graphs, eager)
    for row in decoded:
        assert row["length"] == 96 and row["steps"] == 2 and row["fill"] == "prefill"
        if row["mode"] == "native" and row["graphs"]:
            assert row["status"] == "skipped"
            continue
        assert row["status"] == "ok", row
        assert row["tokens_per_second"]["max"] == pytest.approx(1 / row["seconds"]["min"])
        assert (row["speedup_vs_dense"] == pytest.approx(1.0)) == (row["mode"] == "dense")
    for row in rows:
        assert RESULT_KEYS <= set(row) and row["status"] == "ok", row
        assert set(row["seconds"]) == {"median", "min", "max"} and len(row["seconds_per_seed"]) == 2
        assert row["seconds"]["min"] <= row["seconds"]["median"] <= row["seconds"]["max"]
        assert row["tokens_per_second"]["min"] == pytest.approx(row["tokens"] / row["seconds"]["max"])
        assert row["tokens_per_second"]["max"] == pytest.approx(row["tokens"] / row["seconds"]["min"])
        assert row["peak_memory_gib"] is None  # no CUDA
        if row["mode"] == "dense":
            assert row["speedup_vs_dense"] == pytest.approx(1.0)
        else:
            assert row["speedup_vs_dense"] > 0
        if row["workload"] == "chunked":
            assert row["length"] == 160 and row["chunk_size"] == 64
            assert [len(chunks) for chunks in row["chunk_seconds"]["per_seed"]] == [3, 3]  # 64 + 64 + 32 tokens
    assert {r["mode"]: r.get("indexer_backends") for r in rows if r["workload"] == "fresh" and r["length"] == 96} == {
        "sparse": ["torch"], "sparse-torch": ["torch"], "dense": None, "native": None}
    (layer,) = saved["sparse_layer"]
    assert layer["status"] == "ok" and layer["length"] == 96 and layer["selection"] == "model"
    assert layer["speedup"] == pytest.approx(layer["dense_attention_seconds"] / layer["sparse_attention_seconds"])

    plot = output.with_suffix(".png")
    assert saved["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["kind"] == "throughput" and len(result["results"]) == len(rows) + len(decoded) + len(turns)

    printed = capsys.readouterr().out
    for text in ("TTFT ms, median [min–max]", "input tokens/s", "vs dense", "| chunked 64", "| sparse-torch", "| native",
                 "sparse block ms", "1.00x", "ms per token, median [min–max]", "| graphs", "| eager",
                 "TTFT per turn ms"):
        assert text in printed, text


def test_out_of_memory_is_reported_not_raised(isolated, monkeypatch, capsys):
    real_forward = MiniMaxM3ForCausalLM.forward

    def forward_that_runs_out_of_memory_beyond_128_tokens(self, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[1] > 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real_forward(self, input_ids=input_ids, **kwargs)

    def attention_that_runs_out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(MiniMaxM3ForCausalLM, "forward", forward_that_runs_out_of_memory_beyond_128_tokens)
    monkeypatch.setattr("minimax_m3.bench_prefill.bench_attention", attention_that_runs_out_of_memory)
    output = isolated / "oom.json"
    throughput.run_command(["--preset", "tiny", "--modes", "sparse,dense", *SHORT_RUN, "--output", str(output)])

    rows = json.loads(output.read_text())["results"]
    by_key = {(r["mode"], r["workload"], r["length"]): r for r in rows}
    assert by_key[("sparse", "fresh", 96)]["status"] == "ok" and by_key[("dense", "fresh", 96)]["status"] == "ok"
    for mode in ("sparse", "dense"):
        assert by_key[(mode, "fresh", 160)]["status"] == "OOM"
        assert by_key[(mode, "fresh", 160)]["speedup_vs_dense"] is None
        assert by_key[(mode, "chunked", 160)]["status"] == "ok"  # 64-token chunks stay under the limit
    (layer,) = json.loads(output.read_text())["sparse_layer"]
    assert layer["status"] == "OOM" and layer["speedup"] is None
    printed = capsys.readouterr().out
    assert "| OOM" in printed


def test_no_cuda_falls_back_to_the_tiny_preset_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="eval.throughput"):
        resolved = throughput.resolve_arguments(throughput.build_parser().parse_args([]))
    assert resolved["spec"].preset == "tiny" and resolved["spec"].dtype == torch.float32
    assert [(w.kind, w.length, w.graphs) for w in resolved["workloads"]] == [
        ("fresh", 256, False), ("fresh", 512, False), ("chunked", 512, False), ("decode", 256, True),
        ("decode", 256, False), ("turns", 256, False)]
    assert "falling back from preset m3-geometry to preset tiny" in caplog.text


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="chunk_size"):
        throughput.Workload("chunked", 100, 1, 0)
    parser = throughput.build_parser()
    with pytest.raises(SystemExit, match="either --preset or --model"):
        throughput.resolve_arguments(parser.parse_args(["--preset", "tiny", "--model", "x"]))
    with pytest.raises(SystemExit, match="--modes"):
        throughput.resolve_arguments(parser.parse_args(["--modes", "sparse,linear"]))
    with pytest.raises(SystemExit, match="--chunk-size"):
        throughput.resolve_arguments(parser.parse_args(["--chunked-context", "64", "--chunk-size", "128"]))
    with pytest.raises(SystemExit, match="checkpoint's indexer"):  # refused before any model is loaded
        throughput.run_command(["--model", "x", "--selection", "clustered", "--no-plot"])


def test_clustered_selection_runs_the_sparse_modes_over_clustered_pages(isolated, capsys):
    output = isolated / "clustered.json"
    result = throughput.run_command(["--preset", "tiny", "--modes", "sparse,dense", "--lengths", "160",
                                     "--chunked-context", "160", "--chunk-size", "64", "--seeds", "0",
                                     "--attention-lengths", "96", "--attention-repeats", "1", "--selection", "clustered",
                                     "--decode-contexts", "96", "--decode-steps", "2", "--turns-prefix", "0", "--no-plot",
                                     "--output", str(output)])
    saved = json.loads(output.read_text())
    assert saved["selection"] == "clustered" and saved["sparse_layer_selection"] == "clustered"
    assert [r["status"] for r in saved["results"]] == ["ok"] * 8 and result["selection"] == "clustered"
    assert "sparse modes attend over clustered selections" in capsys.readouterr().out


def test_a_checkpoint_directory_runs_through_model(isolated):
    path = default_model.ensure_default_model(isolated / "checkpoint")
    output = isolated / "checkpoint.json"
    throughput.run_command(["--model", str(path), "--lengths", "96", "--chunked-context", "0", "--seeds", "0",
                     "--attention-lengths", "", "--no-plot", "--output", str(output)])
    saved = json.loads(output.read_text())
    assert saved["model"] == f"--model {path}" and saved["config"]["vocab_size"] == default_model.VOCAB_SIZE
    statuses = {r["mode"]: r["status"] for r in saved["results"]}
    assert statuses == {"sparse": "ok", "sparse-torch": "ok", "dense": "ok", "native": "skipped"}
    assert "presets only" in next(r["reason"] for r in saved["results"] if r["mode"] == "native")
    assert saved["sparse_layer"] == [] and "plot" not in saved


def test_main_job_prints_both_comparisons(isolated, monkeypatch, capsys):
    no_network(monkeypatch)
    eval_main.run_command(["--limit", "2", "--lengths", "96", "--seeds", "0", "--output-dir", str(isolated / "main")])
    printed = capsys.readouterr().out
    assert "Accuracy: sparse vs dense on the same weights" in printed and "| m3_kv_retrieval_short" in printed
    assert "Logit agreement" in printed
    assert "Prefill throughput: preset embedded" in printed and "One sparse layer's attention" in printed
    assert {p.name for p in (isolated / "main").iterdir()} == {"accuracy.json", "throughput.json", "throughput.png"}


def test_sparse_layer_table_shows_the_core_where_it_was_timed():
    on_gpu = {"length": 131072, "selection": "clustered", "sparse_attention_seconds": 0.1, "dense_attention_seconds": 0.5,
              "speedup": 5.0, "sparse_core_seconds": 0.02, "dense_core_seconds": 0.2, "core_speedup": 10.0, "status": "ok"}
    out_of_memory = {"length": 262144, "selection": "clustered", "sparse_attention_seconds": 0.2,
                     "dense_attention_seconds": None, "speedup": None, "status": "OOM (dense)"}
    table = throughput.sparse_layer_table([on_gpu, out_of_memory])
    assert "core speed-up" in table and "10.00x" in table and "5.00x" in table
    assert table.splitlines()[-1].split("|")[4].strip() == "OOM"
    assert "core" not in throughput.sparse_layer_table([out_of_memory])


def test_the_m3_proportions_preset_has_m3s_layer_mix_at_its_attention_geometry():
    spec = throughput.ModelSpec(preset="m3-proportions", path=None, dtype=torch.bfloat16, device=torch.device("cpu"))
    config = throughput.build_preset_config(spec)
    assert config.num_hidden_layers == 60
    assert config.layer_types == ["full_attention"] * 3 + ["minimax_m3_sparse"] * 57
    assert config.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 57
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (6144, 64, 4, 128)
    assert (config.index_n_heads, config.index_head_dim, config.index_block_size, config.index_topk_blocks) == (4, 128, 128, 16)
    attention = config.num_hidden_layers * config.hidden_size * 2 * (64 + 4) * 128
    assert 6.0e9 < attention < 6.6e9  # about 6.4B parameters of attention



def test_a_configuration_whose_timings_spread_beyond_1_5x_is_flagged_noisy(isolated, monkeypatch, capsys):
    """The timer is replaced: per (mode, length), two seeds take the seconds below, so max/min is 1, 1.2, 3 and
    exactly 1.5 (not above the limit)."""
    from matplotlib.container import ErrorbarContainer

    from eval import report

    seconds = iter([1.0, 1.0, 1.0, 1.2, 1.0, 3.0, 2.0, 3.0])  # sparse 32, sparse 64, dense 32, dense 64
    monkeypatch.setattr(throughput, "time_steps", lambda steps, devices: [next(seconds)])
    figures, real_save_figure = [], report.save_figure

    def save_figure(figure, path, **kwargs):
        figures.append(figure)
        return real_save_figure(figure, path, **kwargs)

    monkeypatch.setattr(report, "save_figure", save_figure)
    output = isolated / "noisy.json"
    throughput.run_command(["--preset", "tiny", "--modes", "sparse,dense", "--lengths", "32,64", "--seeds", "0,1",
                            "--warmup", "0", "--chunked-context", "0", "--decode-contexts", "", "--turns-prefix", "0",
                            "--attention-lengths", "", "--output", str(output)])

    rows = {(r["mode"], r["length"]): r for r in json.loads(output.read_text())["results"]}
    assert {key: (r["noisy"], r["max_over_min"]) for key, r in rows.items()} == {
        ("sparse", 32): (False, 1.0), ("sparse", 64): (False, pytest.approx(1.2)), ("dense", 32): (True, 3.0),
        ("dense", 64): (False, 1.5)}

    printed = capsys.readouterr().out
    marked = [line for line in printed.splitlines() if line.startswith("| fresh") and "] *" in line]
    assert len(marked) == 1 and "| dense" in marked[0] and "| 32 " in marked[0]
    assert "* noisy: the slowest timing took more than 1.5x the fastest (up to 3.00x here)" in printed

    (figure,) = figures
    bars = {c.get_label(): c for c in figure.axes[0].containers if isinstance(c, ErrorbarContainer)}
    assert set(bars) == {"sparse", "dense"}
    segments = [segment.tolist() for segment in bars["dense"].lines[2][0].get_segments()]  # x by x: min to max
    assert segments == [[[32, pytest.approx(32 / 3)], [32, 32]], [[64, pytest.approx(64 / 3)], [64, 32]]]


def test_empty_lengths_run_no_fresh_prompts_and_nothing_to_run_is_an_error(isolated, capsys):
    """``--lengths ""`` means no fresh prompts, as an empty ``--attention-lengths`` or ``--decode-contexts`` means
    none of theirs (it used to fall back to the default lengths); a run with no workload at all stops before it
    writes anything."""
    output = isolated / "decode_only.json"
    throughput.run_command(["--preset", "tiny", "--modes", "sparse,dense", "--lengths", "", "--chunked-context", "0",
                            "--attention-lengths", "", "--seeds", "0", "--decode-contexts", "96", "--decode-steps", "1",
                            "--turns-prefix", "0", "--no-plot", "--output", str(output)])
    saved = json.loads(output.read_text())
    assert {r["workload"] for r in saved["results"]} == {"decode"}
    assert "| fresh" not in capsys.readouterr().out
    empty = isolated / "nothing.json"
    with pytest.raises(SystemExit, match="nothing to run"):
        throughput.run_command(["--preset", "tiny", "--lengths", "", "--chunked-context", "0", "--decode-contexts", "",
                                "--turns-prefix", "0", "--output", str(empty)])
    assert not empty.exists()
