"""Results survive failures and are never lost or replaced by accident: atomic writes, partial results flushed per
workload (kept by an interrupted run), existing outputs kept unless ``--overwrite``, and every argument checked
before any work (output paths, the device, counts)."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import eval.__main__ as eval_main
from eval import accuracy, report, throughput


def test_a_failed_write_keeps_the_previous_results_and_leaves_no_temporary(tmp_path):
    """The write fails at a 4 KiB file-size limit (``RLIMIT_FSIZE``) in a subprocess, half-way through."""
    path = tmp_path / "results.json"
    report.write_json(path, {"good": [1, 2, 3]})
    before = path.read_bytes()
    code = textwrap.dedent("""
        import resource, signal, sys
        from eval.report import write_json
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            write_json(sys.argv[1], {"rows": list(range(100000))})
        except OSError as error:
            print("write failed:", error)
            sys.exit(3)
    """)
    finished = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 3, finished.stdout + finished.stderr
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_default_output_names_are_fresh_per_run(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS_DIRECTORY", tmp_path)
    monkeypatch.setattr(report.time, "strftime", lambda _: "20261202-120000")
    first = report.default_output_path("throughput")
    report.write_json(first, {})
    second = report.default_output_path("throughput")
    assert first.name == "throughput-20261202-120000.json" and second.name == "throughput-20261202-120000-2.json"


def refuse_work(*args, **kwargs):
    raise AssertionError("the command started working before checking its arguments")


TINY = ["--preset", "tiny", "--device", "cpu", "--lengths", "32", "--seeds", "0", "--chunked-context", "0",
        "--decode-contexts", "", "--turns-prefix", "0", "--attention-lengths", "", "--no-plot"]


@pytest.mark.parametrize("problem, match", [
    ("existing", "exists: pass --overwrite"),
    ("directory", "is a directory"),
    ("under_a_file", "is a file, not a directory"),
    ("no_repeats", "--attention-repeats must be >= 1"),
])
def test_throughput_checks_its_arguments_before_any_work(problem, match, tmp_path, monkeypatch):
    monkeypatch.setattr(throughput, "run_throughput", refuse_work)
    output = tmp_path / "out.json"
    extra = []
    if problem == "existing":
        output.write_text('{"kept": true}')
    elif problem == "directory":
        output.mkdir()
    elif problem == "under_a_file":
        (tmp_path / "file").write_text("x")
        output = tmp_path / "file" / "out.json"
    else:
        extra = ["--attention-repeats", "0"]
    with pytest.raises(SystemExit, match=match):
        throughput.run_command([*TINY, "--output", str(output), *extra])
    if problem == "existing":
        assert output.read_text() == '{"kept": true}'


def test_overwrite_replaces_an_existing_output(tmp_path):
    output = tmp_path / "out.json"
    output.write_text('{"old": true}')
    throughput.run_command([*TINY, "--modes", "dense", "--output", str(output), "--overwrite"])
    written = json.loads(output.read_text())
    assert written["partial"] is False and written["results"] and "old" not in written


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_one_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(throughput, "run_throughput", refuse_work)
    monkeypatch.setattr(accuracy, "load_for_evaluation", refuse_work)
    with pytest.raises(SystemExit, match="CUDA is not available"):
        throughput.run_command([*TINY[:2], "--device", "cuda", "--output", str(tmp_path / "t.json")])
    with pytest.raises(SystemExit, match="CUDA is not available"):
        accuracy.run_command(["--device", "cuda", "--output", str(tmp_path / "a.json")])
    with pytest.raises(SystemExit, match="CUDA is not available"):
        eval_main.run_command(["--device", "cuda", "--output-dir", str(tmp_path / "all")])
    assert not any(tmp_path.iterdir())


def test_accuracy_and_the_eval_command_keep_existing_results(tmp_path, monkeypatch):
    monkeypatch.setattr(accuracy, "load_for_evaluation", refuse_work)
    existing = tmp_path / "accuracy.json"
    existing.write_text("{}")
    with pytest.raises(SystemExit, match="exists: pass --overwrite"):
        accuracy.run_command(["--device", "cpu", "--output", str(existing)])
    with pytest.raises(SystemExit, match="already holds accuracy.json"):
        eval_main.run_command(["--device", "cpu", "--output-dir", str(tmp_path)])
    assert existing.read_text() == "{}"


def test_an_interrupted_throughput_run_keeps_its_finished_workloads(tmp_path):
    """SIGINT once the first workload is flushed: the command exits with 130 and leaves valid JSON marked
    partial."""
    output = tmp_path / "out.json"
    command = [sys.executable, "-m", "eval.throughput", "--preset", "tiny", "--device", "cpu", "--modes", "sparse,dense",
               "--lengths", "64,128,256,512,1024,2048", "--seeds", "0,1,2,3,4,5,6,7", "--chunked-context", "0",
               "--decode-contexts", "", "--turns-prefix", "0", "--attention-lengths", "", "--no-plot",
               "--output", str(output)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not output.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert output.exists(), "no workload was flushed"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr[-2000:]
    assert "interrupted: the finished workloads are in" in stderr
    written = json.loads(output.read_text())
    assert written["partial"] is True and written["results"] and written["environment"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
