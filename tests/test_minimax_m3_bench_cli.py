"""The model benches' command lines (``minimax_m3.bench_prefill``, ``bench_sparse_attention``, ``bench_decode``):
``--output`` and ``--device`` are checked before any work, an existing output is kept without ``--overwrite``, and
results are written atomically (CPU)."""

import json

import pytest
import torch

from minimax_m3 import bench_decode, bench_prefill, bench_sparse_attention

CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def refuse_work(*args, **kwargs):
    raise AssertionError("the bench started working before checking its arguments")


@pytest.fixture
def no_work(monkeypatch):
    for module, name in ((bench_prefill, "geometry_config"), (bench_prefill, "bench_model"),
                         (bench_prefill, "bench_attention"), (bench_sparse_attention, "cute_sparse_attention_supported"),
                         (bench_sparse_attention, "bench"), (bench_decode, "build"),
                         (bench_decode, "decode_step_profile")):
        monkeypatch.setattr(module, name, refuse_work)


def refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("main", [bench_prefill.main, bench_sparse_attention.main], ids=["prefill", "sparse_attention"])
@pytest.mark.parametrize("problem, match", [
    ("existing", "exists: pass --overwrite"),
    ("directory", "is a directory"),
    ("under_a_file", "is a file, not a directory"),
])
def test_output_is_checked_before_any_work(main, problem, match, tmp_path, capsys, no_work):
    output = tmp_path / "out.json"
    if problem == "existing":
        output.write_text('{"kept": true}')
    elif problem == "directory":
        output.mkdir()
    else:
        (tmp_path / "file").write_text("kept")
        output = tmp_path / "file" / "out.json"
    assert match in refused(main, ["--output", str(output)], capsys)
    if problem == "existing":
        assert output.read_text() == '{"kept": true}'
    elif problem == "under_a_file":
        assert (tmp_path / "file").read_text() == "kept"


@CUDA
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_bench_decode_refuses_a_cuda_device_on_a_machine_without_one(device, capsys, no_work):
    assert "CUDA is not available on this machine" in refused(bench_decode.main, ["--tiny", "--device", device], capsys)


def test_bench_decode_refuses_an_unknown_device(capsys, no_work):
    assert "expected auto, cpu, cuda or cuda:N" in refused(bench_decode.main, ["--tiny", "--device", "tpu"], capsys)


def test_bench_decode_by_operator_needs_eager_steps(capsys, no_work):
    assert "--by-operator needs --eager" in refused(bench_decode.main, ["--tiny", "--by-operator"], capsys)


def test_bench_decode_by_operator_groups_time_by_operator_and_shapes():
    from minimax_m3.bench_prefill import build, geometry_config

    model = build("sparse", geometry_config(1, tiny=True), torch.device("cpu"), torch.float32)
    result = bench_decode.decode_step_profile(model, context=200, batch=2, steps=1, graphs=False, by_operator=True)
    names = list(result["per_step"])
    assert names and all(name.startswith("aten::") and "[[" in name for name in names)
    assert any(name.startswith("aten::mm [[2, ") or name.startswith("aten::addmm") for name in names)


def test_bench_prefill_overwrite_replaces_the_output_atomically(tmp_path, monkeypatch, capsys):
    def fake_model(mode, config, length, device, dtype, repeats, experts_implementation=None):
        return dict(mode=mode, length=length, seconds=0.5, tokens_per_second=length / 0.5, peak_gib=1.0,
                    experts="default")

    monkeypatch.setattr(bench_prefill, "bench_model", fake_model)
    output = tmp_path / "out.json"
    output.write_text('{"old": true}')
    bench_prefill.main(["--lengths", "32", "--modes", "dense", "--output", str(output), "--overwrite"])
    assert json.loads(output.read_text()) == {"partial": False, "results": [fake_model("dense", None, 32, None, None, None)]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary left behind
    assert "| 32 | dense | default | 500.0 |" in capsys.readouterr().out


@CUDA
def test_bench_sparse_attention_without_a_gpu_keeps_an_existing_output(tmp_path, capsys):
    output = tmp_path / "out.json"
    output.write_text('{"kept": true}')
    with pytest.raises(SystemExit, match="needs an SM90 GPU"):
        bench_sparse_attention.main(["--lengths", "256", "--output", str(output), "--overwrite"])
    assert output.read_text() == '{"kept": true}'


@pytest.mark.parametrize("main, argv", [
    (bench_prefill.main, ["--repeats", "0"]),
    (bench_prefill.main, ["--lengths", "96,0"]),
    (bench_prefill.main, ["--sparse-layers", "-1"]),
    (bench_decode.main, ["--tiny", "--steps", "0"]),
    (bench_decode.main, ["--tiny", "--batch", "x"]),
    (bench_sparse_attention.main, ["--repeats", "0"]),
])
def test_counts_below_one_are_refused_before_any_work(main, argv, capsys, no_work):
    assert ">= 1" in refused(main, argv, capsys)


def test_bench_prefill_flushes_each_finished_measurement_as_partial(tmp_path, monkeypatch):
    output = tmp_path / "out.json"
    calls = []

    def fake_model(mode, config, length, device, dtype, repeats, experts_implementation=None):
        calls.append(mode)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return dict(mode=mode, length=length, seconds=0.5, tokens_per_second=length / 0.5, peak_gib=1.0,
                    experts="default")

    monkeypatch.setattr(bench_prefill, "bench_model", fake_model)
    with pytest.raises(KeyboardInterrupt):
        bench_prefill.main(["--lengths", "32", "--modes", "dense,sparse", "--output", str(output)])
    saved = json.loads(output.read_text())
    assert saved["partial"] is True and [r["mode"] for r in saved["results"]] == ["dense"]


def test_kernel_labels_keep_the_functor_that_tells_elementwise_kernels_apart():
    name = ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, "
            "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")
    label = bench_decode.kernel_label(name, width=60)
    assert label == "vectorized_elementwise_kernel<8, CUDAFunctor_add<BFloat16>, array<char*, 3ul> >"[:60]
    assert bench_decode.kernel_label("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"


def test_bench_decode_timeline_needs_cuda(capsys, no_work):
    assert "--timeline needs a CUDA device" in refused(bench_decode.main, ["--tiny", "--device", "cpu", "--timeline"],
                                                       capsys)


def test_a_step_timeline_counts_overlapping_kernels_once_and_the_gaps_as_idle():
    # stream 7: 0-10 and 12-20; stream 8: 5-15 overlaps both; then a lone kernel 30-31
    kernels = [(12.0, 20.0, 7, "b"), (0.0, 10.0, 7, "a"), (5.0, 15.0, 8, "c"), (30.0, 31.0, 7, "d")]
    assert bench_decode.timeline_summary(kernels) == {"span_us": 31.0, "busy_us": 21.0, "idle_us": 10.0,
                                                      "kernel_us": 29.0}
    assert bench_decode.timeline_summary([]) == {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "kernel_us": 0.0}
    # the inputs staged by copies long before the graph's kernels (host time) are not the device's idle time
    staged = [(-2200.0, -2199.0, 7, "Memcpy DtoD (Device -> Device)"), (-3.0, -2.0, 7, "Memset (Device)")]
    assert bench_decode.timeline_summary(staged + kernels) == bench_decode.timeline_summary(kernels)
    # a copy inside the step is work: it fills part of the gap 20-30
    inside = [(22.0, 25.0, 7, "Memcpy DtoD (Device -> Device)")]
    assert bench_decode.timeline_summary(staged + kernels + inside) == {"span_us": 31.0, "busy_us": 24.0,
                                                                        "idle_us": 7.0, "kernel_us": 32.0}


def test_a_timeline_of_a_cpu_model_is_refused_before_any_step():
    class CpuModel:
        def get_input_embeddings(self):
            return torch.nn.Embedding(2, 2)

        def __call__(self, *args, **kwargs):
            raise AssertionError("no step may run")

    with pytest.raises(ValueError, match="timeline needs CUDA"):
        bench_decode.decode_step_profile(CpuModel(), context=16, batch=1, steps=1, graphs=False, timeline=True)
