"""Tensor parallelism through transformers' ``tp_plan="auto"``: 2 and 4 CPU processes over gloo, launched by the
test, against the single-process model on the same checkpoint (``tensor_parallel_worker.py``): prefill with padding,
chunked prefill and greedy decoding give the same logits within 1e-4 (fp32; row-wise splits reorder sums), and the
page selections are equal except for rows whose scores tie within that rounding."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minimax_m3  # noqa: F401  (registers the Auto classes)
from minimax_m3 import MiniMaxM3ForCausalLM
from test_minimax_m3 import SPARSE_CONFIG, tiny_config

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
TOLERANCE = 1e-4


def tensor_parallel_config():
    """tiny_config with 4 KV groups (and index heads) of 2 query heads each: TP4 leaves each rank one group."""
    return tiny_config(vocab_size=128, num_attention_heads=8, num_key_value_heads=4,
                       sparse_attention_config={**SPARSE_CONFIG, "sparse_num_index_heads": 4})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = MiniMaxM3ForCausalLM(tensor_parallel_config())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.1)
    path = tmp_path_factory.mktemp("tp-checkpoint")
    model.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def launch(world: int, checkpoint: Path, out: Path, *, cuda: bool = False) -> list:
    """Run the worker in ``world`` processes: on the CPU over gloo, or with ``cuda`` one GPU each over NCCL (NVLink
    multicast off: NVLS needs resources the lent machines do not give)."""
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER), str(checkpoint), str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    environment.update({"NCCL_NVLS_ENABLE": "0"} if cuda else {"CUDA_VISIBLE_DEVICES": ""})
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def release_layout(tmp_path_factory):
    """A tiny slice in the MXFP8 release's layout (``language_model.`` keys, per-expert w1/w3/w2, composite config)."""
    from minimax_m3 import synthetic_checkpoint as synthetic
    from test_synthetic_checkpoint import TINY

    # row-wise splits cut the MXFP8 scale blocks of 32 input columns: each rank's share must hold whole blocks
    config = synthetic.released_slice_config(1, 2, **{**TINY, "vocab_size": 128, "intermediate_size": 64,
                                                      "shared_intermediate_size": 64,
                                                      "dense_intermediate_size": 128})
    return synthetic.write_synthetic_checkpoint(tmp_path_factory.mktemp("tp-release") / "slice", config, seed=3,
                                                device="cpu")


def check(results: list, world: int) -> None:
    for result in results:
        local = result["kv_heads"] // world
        assert result["world"] == world and result["local_kv_heads"] == local  # whole KV groups per rank
        assert result["indexer_heads"] == [local]  # each rank's indexer runs H = KV groups / ranks
        assert result["prefill_max_abs_difference"] <= TOLERANCE
        assert result["chunked_max_abs_difference"] <= TOLERANCE
        assert result["decode_tokens_equal"] and result["decode_max_abs_difference"] <= TOLERANCE
        assert result["selection_shapes_equal"]  # every KV group's pages, gathered from the ranks
        selections = result["selections"]
        assert selections["rows"] > 0 and selections["not_ties"] == 0, selections


@pytest.mark.parametrize("world, layout", [(2, "ours"), (4, "ours"), (2, "release")])
def test_tensor_parallel_ranks_compute_the_single_process_model(world, layout, checkpoint, release_layout, tmp_path):
    check(launch(world, checkpoint if layout == "ours" else release_layout, tmp_path / "out"), world)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_over_nccl_computes_the_single_gpu_model(world, checkpoint, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    results = launch(world, checkpoint, tmp_path / "out", cuda=True)
    check(results, world)
    assert all(result["device"].startswith("cuda") for result in results)


def test_a_split_that_cuts_scale_blocks_raises_naming_the_field():
    from minimax_m3.loading import check_tensor_parallel_split

    config = tensor_parallel_config()
    mxfp8 = {"quant_method": "mxfp8", "weight_block_size": [1, 32]}
    check_tensor_parallel_split(tiny_config(dense_intermediate_size=128, intermediate_size=64,
                                            shared_intermediate_size=64), mxfp8, 2)
    with pytest.raises(ValueError, match="dense_intermediate_size = 96 split among 2 tensor-parallel ranks gives 48"):
        check_tensor_parallel_split(config, mxfp8, 2)
    with pytest.raises(ValueError, match="^intermediate_size = 48 does not split among 5"):
        check_tensor_parallel_split(tiny_config(num_attention_heads=5, num_key_value_heads=5,
                                                sparse_attention_config={**SPARSE_CONFIG, "sparse_num_index_heads": 5},
                                                dense_intermediate_size=100), None, 5)
    check_tensor_parallel_split(config, None, 4)  # unquantised: any even split
    # the MoE widths count only where the model has MoE layers
    dense_only = tiny_config(intermediate_size=50, moe_layer_freq=[0, 0, 0])
    check_tensor_parallel_split(dense_only, None, 2)
    with pytest.raises(ValueError, match="num_key_value_heads = 4 must be a multiple of the 8 tensor-parallel ranks"):
        check_tensor_parallel_split(config, None, 8)


def test_the_throughput_command_times_each_layout_and_refuses_a_layout_outside_its_launcher(tmp_path, monkeypatch,
                                                                                              capsys):
    from eval import tensor_parallel

    monkeypatch.delenv("RANK", raising=False)
    checkpoint = tmp_path / "model"
    common = ["--preset", "tiny", "--checkpoint", str(checkpoint), "--lengths", "64", "--repeats", "1"]
    single = tensor_parallel.run_command(["--layout", "single", *common, "--output", str(tmp_path / "single.json")])
    assert single["rows"][0]["length"] == 64 and single["rows"][0]["tokens_per_second"] > 0
    assert (checkpoint / "config.json").is_file() and single["gpus"] == 1
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "eval.tensor_parallel", "--layout", "tp", *common,
               "--output", str(tmp_path / "tp.json")]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert completed.returncode == 0, completed.stderr[-3000:]
    parallel = json.loads((tmp_path / "tp.json").read_text())
    assert parallel["processes"] == 2 and parallel["layout"] == "tp" and len(parallel["rows"][0]["seconds"]) == 1
    with pytest.raises(SystemExit):
        tensor_parallel.main(["--layout", "tp", *common, "--output", str(tmp_path / "x.json")])
    assert "runs under torch.distributed.run" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_device_map_layout_splits_layers_in_contiguous_blocks():
    from eval.tensor_parallel import layer_device_map

    mapping = layer_device_map(tiny_config(num_hidden_layers=4, moe_layer_freq=[0, 1, 1, 1],
                                           sparse_attention_config={**SPARSE_CONFIG,
                                                                    "sparse_attention_freq": [0, 1, 1, 1]}), 2)
    assert [mapping[f"model.layers.{i}"] for i in range(4)] == [0, 0, 1, 1]
    assert mapping["model.embed_tokens"] == 0 and mapping["lm_head"] == 1
