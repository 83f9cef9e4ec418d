"""One rank of ``tests/test_tensor_parallel.py``: launched by ``torch.distributed.run``, it loads the checkpoint with
``tp_plan="auto"`` (gloo on CPU, NCCL on CUDA) and without, runs prefill (with padding), chunked prefill and greedy
decoding through both, and writes what it measured to ``OUT/rank<r>.json``.

Page selections are compared against the single-process model's up to ties (``selection_ties``: the row-wise
splits reorder sums, so the index queries differ by rounding)."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import minimax_m3  # noqa: F401  (registers the Auto classes)
from minimax_m3 import MiniMaxM3Cache, MiniMaxM3ForCausalLM
from selection_ties import selection_differences

def main(checkpoint: str, out: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    rank = dist.get_rank()
    parallel = MiniMaxM3ForCausalLM.from_pretrained(checkpoint, tp_plan="auto", dtype=torch.float32).eval()
    reference = MiniMaxM3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(parallel.device).eval()
    vocab = reference.config.vocab_size
    ids = torch.randint(3, vocab, (2, 41), generator=torch.Generator().manual_seed(1)).to(parallel.device)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    result = {"rank": rank, "world": dist.get_world_size(), "device": str(parallel.device),
              "local_kv_heads": parallel.model.layers[1].self_attn.k_proj.weight.to_local().shape[0]
              // reference.config.head_dim,
              "kv_heads": reference.config.num_key_value_heads}
    with torch.no_grad():
        got = parallel(ids, attention_mask=mask, output_page_selections=True)
        expected = reference(ids, attention_mask=mask, output_page_selections=True)
        real = mask.bool()
        result["prefill_max_abs_difference"] = float((got.logits - expected.logits)[real].abs().max())
        result["selection_shapes_equal"] = all(a.shape == b.shape for a, b in zip(got.page_selections,
                                                                                  expected.page_selections))
        result["selections"] = selection_differences(reference, ids, mask, got.page_selections,
                                                    expected.page_selections)

        parallel_cache, reference_cache = MiniMaxM3Cache(parallel.config), MiniMaxM3Cache(reference.config)
        differences = []
        for columns in (slice(0, 25), slice(25, 41)):
            a = parallel(ids[:, columns], past_key_values=parallel_cache, use_cache=True).logits
            b = reference(ids[:, columns], past_key_values=reference_cache, use_cache=True).logits
            differences.append(float((a - b).abs().max()))
        result["chunked_max_abs_difference"] = max(differences)

        generated = parallel.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True)
        expected_generation = reference.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                                 output_logits=True, return_dict_in_generate=True)
        result["indexer_heads"] = sorted(wrapper.num_heads for wrapper in parallel.model.page_selector._wrappers.values())
        result["decode_tokens_equal"] = bool(torch.equal(generated.sequences, expected_generation.sequences))
        result["decode_max_abs_difference"] = max(float((a - b).abs().max()) for a, b in
                                                  zip(generated.logits, expected_generation.logits))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
