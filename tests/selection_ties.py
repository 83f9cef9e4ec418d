"""Page selections of two runs of one model that round differently (another device, row-wise tensor-parallel
sums), compared up to ties: the top-k ranks 16-bit quantised page scores, so a page whose exact score lies within a
quantisation level or two of the k-th best may fall either way."""

import torch

from eval.layer_inputs import capture_sparse_layer_inputs, single_pass
from indexer import differentiable_page_scores
from indexer.contract import QUANT_LEVELS

TIE_LEVELS = 2
"""How many of a row's quantisation levels (its history's score range / ``QUANT_LEVELS``) make a tie."""


def selection_differences(reference, ids, mask, got_selections, expected_selections) -> dict:
    """``got_selections`` against ``expected_selections`` (``reference``'s own, per sparse layer ``[B, T, G, k]``)
    for the batch ``ids`` / ``mask``: ``{"rows": rows compared, "different": rows whose page sets differ,
    "not_ties": those of them where a swapped page's exact score lies more than ``TIE_LEVELS`` levels from the
    expected k-th best page's, "first_different": per sequence, the first real token whose pages differ in any
    layer (None where none does)}``."""
    with capture_sparse_layer_inputs(reference) as captured, torch.no_grad():
        reference.model(input_ids=ids, attention_mask=mask, use_cache=False)
    config = reference.config
    real = mask.bool()
    rows = different = not_ties = 0
    first_different = [None] * ids.shape[0]
    for layer_input, got_layer, expected_layer in zip(single_pass(reference, captured), got_selections,
                                                      expected_selections):
        attention = layer_input.attention
        with torch.no_grad():
            index_q, index_k = attention.index_query_key(layer_input.x, layer_input.cos, layer_input.sin,
                                                         index_dtype=config.index_dtype)
        for sequence, tokens, positions in layer_input.sequences():
            scores = differentiable_page_scores(index_q[tokens], index_k[tokens], positions,
                                                page_size=config.index_block_size)
            got = got_layer[sequence].cpu()[real[sequence].cpu()]
            expected = expected_layer[sequence].cpu()[real[sequence].cpu()]
            for t in range(got.shape[0]):
                for g in range(got.shape[1]):
                    rows += 1
                    a = {int(p) for p in got[t, g] if p >= 0}
                    b = {int(p) for p in expected[t, g] if p >= 0}
                    if a == b:
                        continue
                    different += 1
                    if first_different[sequence] is None or t < first_different[sequence]:
                        first_different[sequence] = t
                    row = scores[t, g].float()
                    local = int(positions[t]) // config.index_block_size  # forced in, whatever its score
                    level = float(row[:local].max() - row[:local].min()) / QUANT_LEVELS
                    kth = float(row[sorted(b - {local})].min())
                    if any(abs(float(row[p]) - kth) > TIE_LEVELS * level + 1e-6 for p in a ^ b):
                        not_ties += 1
    return {"rows": rows, "different": different, "not_ties": not_ties, "first_different": first_different}
