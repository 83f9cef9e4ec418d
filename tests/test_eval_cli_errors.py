"""Bad input to the eval commands: every ``main`` refuses it before any work with one line ``error: ...`` on stderr and
status 2 (a runtime failure: 1), writes nothing, and shows the traceback only with ``--debug``."""

import sys

import pytest
import torch

import eval.__main__ as eval_main
from eval import (accuracy, lm_eval_cli, real_width, retrieval_accuracy, selection_locality, throughput, train_tiny,
                  training_curves)
from eval.cli import run_main
from eval.tasks import make_retrieval
from eval_isolation import isolate, no_network

MAINS = {"eval": eval_main.main, "throughput": throughput.main, "accuracy": accuracy.main,
         "retrieval_accuracy": retrieval_accuracy.main, "selection_locality": selection_locality.main,
         "training_curves": training_curves.main, "real_width": real_width.main,
         "make_retrieval": make_retrieval.main}
TINY = ["--preset", "tiny", "--device", "cpu", "--lengths", "32", "--seeds", "0", "--chunked-context", "0",
        "--decode-contexts", "", "--turns-prefix", "0", "--attention-lengths", "", "--no-plot"]
NO_MODEL = "no such directory, nor a hub id in the local Hugging Face cache (runs are offline)"
CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture
def paths(monkeypatch, tmp_path):
    """``out``: where a command may write (must stay absent); ``empty``: an empty directory; ``file``: a file."""
    isolate(monkeypatch, tmp_path)
    no_network(monkeypatch)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("kept")
    return {"out": tmp_path / "out", "empty": tmp_path / "empty", "file": tmp_path / "file"}


def refuse_work(*args, **kwargs):
    raise AssertionError("the command started working before checking its arguments")


def failed(main, argv, capsys) -> tuple:
    """``(exit status, stderr)`` of ``main(argv)``."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return exited.value.code, capsys.readouterr().err


def assert_one_line(stderr: str, fragment: str) -> str:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and fragment in lines[0], lines[0]
    return lines[0]


CASES = [
    ("throughput", ["--device", "cpu", "--model", "/no/such/dir", "--output", "{out}/t.json"], NO_MODEL),
    ("throughput", ["--model", "{empty}", "--output", "{out}/t.json"], "{empty}: the directory has no config.json"),
    ("throughput", ["--model", "{file}", "--output", "{out}/t.json"], "is a file: give a checkpoint directory"),
    ("throughput", [*TINY, "--seeds", "", "--output", "{out}/t.json"], "--seeds must list at least one seed"),
    ("throughput", [*TINY, "--sparse-layers", "0", "--output", "{out}/t.json"], "--sparse-layers must be >= 1"),
    ("throughput", [*TINY, "--device-map", "auto", "--output", "{out}/t.json"], "--device-map applies to --model only"),
    ("throughput", [*TINY, "--output", "{file}/t.json"], "is a file, not a directory"),
    ("accuracy", ["--model", "/no/such/dir", "--output", "{out}/a.json"], NO_MODEL),
    ("accuracy", ["--tasks", "m3_kv_retrieval_short,no_such_task", "--output", "{out}/a.json"],
     "unknown task(s) no_such_task: the bundled tasks are m3_bundled, m3_kv_retrieval_long"),
    ("accuracy", ["--model", "embedded", "--tasks", "lambada_openai", "--device", "cpu", "--output", "{out}/a.json"],
     "task lambada_openai: its data is not in the local Hugging Face cache and runs are offline"),
    ("accuracy", ["--modes", "sparse,sparse", "--output", "{out}/a.json"], "--modes must be two different modes"),
    ("accuracy", ["--limit", "1.5", "--output", "{out}/a.json"], "--limit must be a whole number of documents"),
    ("accuracy", ["--model", "embedded", "--tokenizer", "{empty}", "--output", "{out}/a.json"],
     "--tokenizer and --device-map need a checkpoint"),
    ("eval", ["--seeds", "x", "--output-dir", "{out}"], "--seeds must be comma-separated integers"),
    ("eval", ["--limit", "0", "--output-dir", "{out}"], "--limit must be positive"),
    ("eval", ["--output-dir", "{file}"], "--output-dir {file} is a file"),
    ("retrieval_accuracy", ["--model", "/no/such/dir", "--output", "{out}/r.json"], NO_MODEL),
    ("retrieval_accuracy", ["--documents", "0", "--output", "{out}/r.json"], "--documents must be >= 1"),
    ("retrieval_accuracy", ["--variants", "sparse", "--output", "{out}/r.json"], "--variants must include dense"),
    ("retrieval_accuracy", ["--tasks", "trivia", "--output", "{out}/r.json"], "--tasks must be among key_value"),
    pytest.param("retrieval_accuracy", ["--device", "cuda", "--output", "{out}/r.json"], "CUDA is not available",
                 marks=CUDA),
    ("retrieval_accuracy", ["--plot", "{empty}"], "--plot {empty} is a directory"),
    ("selection_locality", ["--model", "/no/such/dir", "--device", "cpu", "--output", "{out}/s.json"], NO_MODEL),
    ("selection_locality", ["--documents", "0", "--output", "{out}/s.json"], "--documents must be at least 1"),
    pytest.param("selection_locality", ["--device", "cuda:0", "--output", "{out}/s.json"], "CUDA is not available",
                 marks=CUDA),
    ("retrieval_accuracy", ["--output", "{file}"], "exists: pass --overwrite to replace it"),
    ("selection_locality", ["--device", "cpu", "--output", "{file}"], "exists: pass --overwrite to replace it"),
    ("training_curves", ["{empty}", "--output", "{out}/c.png"], "no training_log.jsonl"),
    ("real_width", ["--modes", "sparse,fast", "--device", "cpu", "--output", "{out}/w.json"], "--modes: unknown"),
    ("make_retrieval", ["--output-dir", "{file}"], "--output-dir {file} is a file"),
]


@pytest.mark.parametrize("command, argv, fragment", CASES)
def test_bad_input_is_one_line_and_status_2_before_any_work(command, argv, fragment, paths, monkeypatch, capsys):
    for module, name in ((throughput, "run_throughput"), (accuracy, "load_for_evaluation"),
                         (accuracy, "run_command" if command == "eval" else "evaluate_accuracy"),
                         (retrieval_accuracy, "evaluate_retrieval_accuracy"),
                         (selection_locality, "measure_selection_locality"),
                         (training_curves, "plot_training_curves"), (real_width, "slice_part"),
                         (real_width, "layer_part"), (make_retrieval, "write_variant")):
        monkeypatch.setattr(module, name, refuse_work)
    argv = [a.format(**paths) for a in argv]
    status, stderr = failed(MAINS[command], argv, capsys)
    assert status == 2
    assert_one_line(stderr, fragment.format(**paths))
    assert not paths["out"].exists() and not any(paths["empty"].iterdir())
    assert paths["file"].read_text() == "kept"


@pytest.mark.parametrize("command, argv", [
    ("throughput", ["--model", "/no/such/dir", "--output", "{out}/t.json"]),
    ("accuracy", ["--model", "/no/such/dir", "--output", "{out}/a.json"]),
    ("real_width", ["--modes", "fast", "--device", "cpu", "--output", "{out}/w.json"]),
])
def test_debug_shows_the_traceback_and_keeps_the_status(command, argv, paths, capsys):
    status, stderr = failed(MAINS[command], [*[a.format(**paths) for a in argv], "--debug"], capsys)
    assert status == 2
    assert stderr.startswith("Traceback (most recent call last)") and "SystemExit" in stderr
    assert stderr.strip().splitlines()[-1].startswith("error: ")
    assert not paths["out"].exists()


@pytest.mark.parametrize("error, status, line", [
    (RuntimeError("boom"), 1, "error: RuntimeError: boom (unexpected; rerun with --debug for the traceback)"),
    (OSError(28, "No space left on device"), 1, "error: [Errno 28] No space left on device"),
])
def test_runtime_failures_are_one_line_and_debug_shows_where(error, status, line, paths, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(throughput, "run_throughput", fail)
    argv = [*TINY, "--output", str(paths["out"] / "t.json")]
    code, stderr = failed(throughput.main, argv, capsys)
    assert code == status and assert_one_line(stderr, "") == line
    code, stderr = failed(throughput.main, [*argv, "--debug"], capsys)
    assert code == status and "Traceback (most recent call last)" in stderr and "in fail" in stderr
    assert stderr.strip().splitlines()[-1] == line
    assert not paths["out"].exists()


def test_argparse_errors_help_and_interrupts_keep_their_own_output(paths, capsys):
    status, stderr = failed(throughput.main, ["--lengths"], capsys)
    assert status == 2 and "usage: python -m eval.throughput" in stderr and "expected one argument" in stderr
    with pytest.raises(SystemExit) as exited:
        accuracy.main(["--help"])
    assert exited.value.code == 0 and "--debug" in capsys.readouterr().out

    def interrupted(argv):
        raise KeyboardInterrupt

    status, stderr = failed(lambda argv: run_main(interrupted, argv), [], capsys)
    assert status == 130
    assert_one_line(stderr, "error: interrupted")


def test_train_tinys_command_line_refuses_a_directory_that_holds_something(paths, monkeypatch, capsys):
    """``main`` reports in one line, from the command line or with argv; ``run_command`` raises."""
    (paths["empty"] / "notes.txt").write_text("keep")
    argv = ["--smoke", "--output", str(paths["empty"]), "--device", "cpu"]
    monkeypatch.setattr(sys, "argv", ["python -m eval.train_tiny", *argv])
    status, stderr = failed(train_tiny.main, None, capsys)
    assert status == 2
    assert_one_line(stderr, f"--output {paths['empty']} is not empty (it holds notes.txt)")
    assert sorted(p.name for p in paths["empty"].iterdir()) == ["notes.txt"]
    status, stderr = failed(train_tiny.main, argv, capsys)
    assert status == 2 and "is not empty" in stderr
    with pytest.raises(ValueError, match="is not empty"):
        train_tiny.run_command(argv)


def test_lm_eval_cli_hands_over_all_but_debug(monkeypatch, capsys):
    import lm_eval.__main__

    seen = []

    def cli_evaluate():
        seen.append(sys.argv[1:])
        raise RuntimeError("lm-eval failed")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", cli_evaluate)
    monkeypatch.setattr(sys, "argv", ["minimax-m3-lm-eval"])
    status, stderr = failed(lm_eval_cli.main, ["--tasks", "x", "--debug"], capsys)
    assert seen == [["--tasks", "x"]] and status == 1 and "Traceback (most recent call last)" in stderr
    status, stderr = failed(lm_eval_cli.main, ["--tasks", "x"], capsys)
    assert status == 1
    assert_one_line(stderr, "RuntimeError: lm-eval failed (unexpected; rerun with --debug for the traceback)")


def test_debug_after_a_double_dash_is_an_argument_not_the_flag(capsys):
    def command(argv):
        raise SystemExit(f"got {argv}")

    with pytest.raises(SystemExit):
        run_main(command, ["--", "--debug"])
    assert "Traceback" not in capsys.readouterr().err


def test_training_curves_keep_an_existing_output_unless_overwrite(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "training_log.jsonl").write_text('{"event": "plan"}\n')
    existing = tmp_path / "curves.png"
    existing.write_text("kept")
    drawn = []
    monkeypatch.setattr(training_curves, "plot_training_curves", lambda records, output: drawn.append(output) or output)
    status, stderr = failed(training_curves.main, [str(run), "--output", str(existing)], capsys)
    assert status == 2 and "exists: pass --overwrite to replace it" in stderr
    assert existing.read_text() == "kept" and not drawn
    training_curves.main([str(run), "--output", str(existing), "--overwrite"])
    training_curves.main([str(run)])  # the run's own plot is redrawn in place
    assert drawn == [existing, run / "training_curves.png"]
