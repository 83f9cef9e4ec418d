"""lm-eval's own command line on our checkpoints, run as a user runs it: in a fresh process, from another directory,
offline, with its usual flags; through our entry point, and plain ``lm_eval`` with ``trust_remote_code``."""

import json
import os
import subprocess
import sys

import pytest

from eval.tasks import TASK_DIRECTORY
from eval.trained_model import trained_model_dir

FLAGS = ["--tasks", "m3_kv_retrieval_short", "--include_path", str(TASK_DIRECTORY), "--limit", "2", "--batch_size", "1",
         "--device", "cpu"]


def run(arguments, tmp_path):
    environment = dict(os.environ, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                       TRANSFORMERS_OFFLINE="1", MPLCONFIGDIR=str(tmp_path / "matplotlib"))
    work = tmp_path / "elsewhere"
    work.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, *arguments], cwd=work, env=environment, capture_output=True, text=True,
                          timeout=600)


def test_our_entry_point_runs_lm_evals_cli_with_its_usual_flags(tmp_path):
    output = tmp_path / "results"
    model_args = f"pretrained={trained_model_dir()},dtype=float32"
    done = run(["-m", "eval.lm_eval_cli", "--model", "hf", "--model_args", model_args, *FLAGS,
                "--output_path", str(output), "--log_samples"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = output.rglob("results_*.json")
    (samples,) = output.rglob("samples_m3_kv_retrieval_short_*.jsonl")
    scores = json.loads(results.read_text())["results"]["m3_kv_retrieval_short"]
    assert 0.0 <= scores["acc,none"] <= 1.0
    assert len(samples.read_text().splitlines()) == 2


def test_plain_lm_eval_loads_our_checkpoint_with_trust_remote_code_and_says_so_without(tmp_path):
    model_args = f"pretrained={trained_model_dir()},dtype=float32"
    done = run(["-m", "lm_eval", "--model", "hf", "--model_args", model_args + ",trust_remote_code=True", *FLAGS],
               tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "m3_kv_retrieval_short" in done.stdout
    refused = run(["-m", "lm_eval", "--model", "hf", "--model_args", model_args, *FLAGS], tmp_path)
    assert refused.returncode != 0
    assert "trust_remote_code=True" in refused.stderr and "does not recognize this architecture" not in refused.stderr


@pytest.mark.parametrize("trust_remote_code", [True, False])
def test_a_saved_checkpoint_carries_the_auto_map_to_this_package(tmp_path, trust_remote_code):
    """save_pretrained writes the auto_map and its two import modules; a process that never imported minimax_m3
    loads the checkpoint with trust_remote_code=True and gets a clear request for it otherwise."""
    from test_minimax_m3 import tiny_model

    tiny_model().save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_minimax_m3.MiniMaxM3ForCausalLM"
    script = ("import sys\nfrom transformers import AutoModelForCausalLM\n"
              f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'model')!r}, "
              f"trust_remote_code={trust_remote_code})\n"
              "print(type(model).__module__, type(model).__name__)\n")
    done = run(["-c", script], tmp_path)
    if trust_remote_code:
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["minimax_m3.modeling_minimax_m3", "MiniMaxM3ForCausalLM"]
    else:
        assert done.returncode != 0 and "trust_remote_code=True" in done.stderr
