"""eval.real_width on CPU: the estimate's arithmetic, the extrapolation, the experts' FLOPs, and both parts end to
end on a tiny slice written in the release's layout (the timings on CPU mean nothing; the schema and the
bookkeeping do)."""

import json

import pytest

from eval import real_width
from eval_isolation import isolate
from minimax_m3 import synthetic_checkpoint as synthetic
from test_synthetic_checkpoint import tiny_slice


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    return tmp_path


def test_the_release_has_3_dense_and_57_sparse_layers():
    assert real_width.release_layer_counts() == (3, 57)


def test_the_estimate_is_3_dense_plus_57_sparse_layers_plus_what_lies_outside_them():
    config = tiny_slice()  # layer 0 dense, layers 1-2 sparse
    parts = {(0, "layer"): 10.0, (0, "attention"): 7.0, (0, "mlp"): 3.0,
             (1, "layer"): 4.0, (1, "attention"): 1.0, (1, "mlp"): 2.5,
             (2, "layer"): 6.0, (2, "attention"): 2.0, (2, "mlp"): 3.5}
    estimate = real_width.estimate_time_to_first_token(config, parts, total_ms=21.5)
    assert estimate["dense_layer_ms"] == 10.0 and estimate["sparse_layer_ms"] == 5.0  # the median of 4 and 6
    assert estimate["sparse_layer_attention_ms"] == 1.5 and estimate["sparse_layer_mlp_ms"] == 3.0
    assert estimate["outside_layers_ms"] == pytest.approx(1.5)
    assert estimate["estimated_ms"] == pytest.approx(3 * 10.0 + 57 * 5.0 + 1.5)
    assert real_width.estimate_time_to_first_token(config, parts, 21.5, counts=(1, 2))["estimated_ms"] == pytest.approx(21.5)
    with pytest.raises(ValueError, match="no dense layer"):
        real_width.estimate_time_to_first_token(config, {k: v for k, v in parts.items() if k[0] != 0}, 11.0)


def test_the_dense_extrapolation_is_exact_for_a_quadratic_with_a_linear_term():
    def seconds(length):
        return 3e-12 * length**2 + 2e-7 * length

    points = [(1 << 17, seconds(1 << 17)), (1 << 18, seconds(1 << 18))]
    assert real_width.quadratic_extrapolation(points, 1 << 20) == pytest.approx(seconds(1 << 20), rel=1e-9)
    with pytest.raises(ValueError, match="two timed lengths"):
        real_width.quadratic_extrapolation(points[:1], 1 << 20)


def test_the_experts_flops_count_the_router_the_routed_and_the_shared_experts():
    config = synthetic.released_slice_config(3, 2)
    per_token = 2 * 6144 * 128 + 2 * 3 * 6144 * (4 * 3072 + 3072)
    assert real_width.experts_flops(config, 32768) == per_token * 32768


def test_both_parts_end_to_end_on_a_tiny_slice(isolated, capsys):
    path = synthetic.write_synthetic_checkpoint(isolated / "slice", tiny_slice(), seed=1, device="cpu")
    output = isolated / "real_width.json"
    result = real_width.run(["--checkpoint", str(path), "--lengths", "40,72", "--chunk", "16", "--chunk-context", "72",
                             "--experts-length", "72", "--native-lengths", "40", "--layer-lengths", "48,96,192",
                             "--layer-dense-max", "96", "--repeats", "1", "--device", "cpu", "--output", str(output)])
    saved = json.loads(output.read_text())
    assert saved["partial"] is False and saved["load"]["layers"] == 3 and saved["matmul_tflops"] > 0
    runs = saved["runs"]
    assert [(r["mode"], r["workload"], r["tokens"]) for r in runs] == [
        ("sparse", "fresh", 40), ("sparse", "fresh", 72), ("sparse", "chunk", 16),
        ("dense", "fresh", 40), ("dense", "fresh", 72), ("dense", "chunk", 16),
        ("native", "fresh", 40), ("native", "chunk", 16)]
    for r in runs:
        assert r["status"] == "ok" and r["ms"] > 0
        if r["mode"] != "native":
            assert set(r["parts"]) == {f"{i}.{part}" for i in range(3) for part in ("layer", "attention", "mlp")}
            assert sum(r["parts"][f"{i}.layer"] for i in range(3)) <= r["ms"]
            assert r["estimate"]["estimated_ms"] > r["ms"]  # 60 layers take longer than 3
    assert [(e["workload"], e["tokens"]) for e in saved["estimates"]] == [("chunk", 16), ("fresh", 40), ("fresh", 72)]
    assert saved["experts"]["tokens"] == 72 and saved["experts"]["fraction_of_matmul"] > 0
    layer = saved["layer"]
    assert [(r["length"], r["dense_timed"]) for r in layer] == [(48, True), (96, True), (192, False)]
    assert layer[2]["dense_attention_extrapolated_seconds"] is not None and layer[2]["sparse_attention_seconds"] > 0
    out = capsys.readouterr().out
    assert "estimated whole model ms" in out and "(extrapolated)" in out and "mapped shard pages" in out
    assert result["partial"] is False


@pytest.mark.parametrize("argv, message", [
    (["--modes", "sparse,fast"], "--modes: unknown ['fast']"),
    (["--chunk", "200", "--chunk-context", "100"], "--chunk must lie in [0, --chunk-context)"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--layer-lengths", ""], "nothing to run"),
])
def test_bad_arguments_are_named_before_any_work(isolated, argv, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        real_width.run([*argv, "--device", "cpu", "--output", str(isolated / "x.json")])
    assert not (isolated / "x.json").exists()


@pytest.mark.parametrize("argv", [["--lengths", "8K"], ["--native-lengths", "0"], ["--layer-lengths", "1,-2"]])
def test_bad_lengths_are_argument_errors(isolated, argv, capsys):
    with pytest.raises(SystemExit) as exited:
        real_width.run([*argv, "--device", "cpu", "--output", str(isolated / "x.json")])
    assert exited.value.code == 2 and argv[0] in capsys.readouterr().err
    assert not (isolated / "x.json").exists()


def test_a_directory_without_a_config_is_refused(isolated):
    with pytest.raises(SystemExit, match="not a checkpoint directory"):
        real_width.run(["--checkpoint", str(isolated), "--device", "cpu"])


def test_clustered_selections_are_recorded_on_the_sparse_runs(isolated):
    path = synthetic.write_synthetic_checkpoint(isolated / "slice", tiny_slice(), seed=2, device="cpu")
    result = real_width.run(["--checkpoint", str(path), "--modes", "sparse,dense", "--lengths", "64", "--chunk", "0",
                             "--experts-length", "64", "--layer-lengths", "", "--selection", "clustered",
                             "--repeats", "1", "--device", "cpu", "--output", str(isolated / "c.json")])
    assert [(r["mode"], r["selection"]) for r in result["runs"]] == [("sparse", "clustered"), ("dense", None)]
    assert result["estimates"][0]["selection"] == "clustered"
