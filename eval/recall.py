"""Indexer recall: the share of dense attention's probability mass that falls in the pages the indexer selected.

For a sparse layer, a (query token, KV group) row keeps the attention mass of its selected pages
(``output_page_selections``) and loses the rest; recall is the kept share, with the dense attention
probabilities computed from the same layer inputs the sparse forward saw
(``minimax_m3.sparse_attention.dense_attention_page_mass``), averaged over rows. Rows whose token has at most
``topk`` causal pages select all of them, so their recall is 1; ``recall_beyond_topk`` averages only the rows
with more pages, where the selection decides something. In a retrieval document most rows read prose and only the
rows that predict the answer need the passage that holds it: ``recall_at_answer`` averages those rows alone (given
to ``RecallAccumulator.add`` as ``answer_rows``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch

from indexer import causal_page_counts
from minimax_m3.sparse_attention import dense_attention_page_mass

from .layer_inputs import SparseLayerInput, capture_sparse_layer_inputs, single_pass

__all__ = ["LayerRecall", "RecallAccumulator", "indexer_recall"]


@dataclass(frozen=True)
class LayerRecall:
    layer: int
    recall: float  # mean over all (token, KV group) rows
    rows: int
    recall_beyond_topk: Optional[float]  # mean over rows with more than topk causal pages; None without such rows
    rows_beyond_topk: int
    recall_at_answer: Optional[float] = None  # mean over the rows given as answer rows; None without such rows
    answer_rows: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class RecallAccumulator:
    """Sums the kept mass per sparse layer over several forwards (e.g. the batches of one length)."""

    def __init__(self):
        self._sums: Dict[int, list] = {}

    def add(self, layer_input: SparseLayerInput, packed_selection: torch.Tensor,
            answer_rows: Optional[torch.Tensor] = None) -> None:
        """``packed_selection`` ``[T, G, topk]``: the layer's selected page ids for the packed tokens (-1 = none);
        ``answer_rows``: indices of the packed tokens whose rows also count towards ``recall_at_answer``."""
        attention = layer_input.attention
        config = attention.config
        answer = None
        if answer_rows is not None:
            answer_rows = torch.as_tensor(answer_rows, dtype=torch.long).cpu()
            num_tokens = packed_selection.shape[0]
            if answer_rows.dim() != 1 or (answer_rows.numel() and not (0 <= int(answer_rows.min())
                                                                      and int(answer_rows.max()) < num_tokens)):
                raise ValueError(f"answer_rows must be a 1-D tensor of packed token indices in [0, {num_tokens}), got "
                                 f"shape {tuple(answer_rows.shape)}"
                                 + (f" with values in [{int(answer_rows.min())}, {int(answer_rows.max())}]"
                                    if answer_rows.numel() else ""))
            answer = torch.zeros(num_tokens, dtype=torch.bool)
            answer[answer_rows] = True
        with torch.no_grad():
            q, k, _ = attention.query_key_value(layer_input.x, layer_input.cos, layer_input.sin)
            sums = self._sums.setdefault(layer_input.layer_index, [0.0, 0, 0.0, 0, 0.0, 0])
            for _, tokens, positions in layer_input.sequences():
                mass = dense_attention_page_mass(q[tokens], k[tokens], positions, scale=attention.scale,
                                                 page_size=config.index_block_size)
                selection = packed_selection[tokens].to(mass.device).long()
                kept = (mass.gather(-1, selection.clamp(min=0)) * (selection >= 0)).sum(-1)  # [n, G]
                beyond = (causal_page_counts(positions, config.index_block_size) > config.index_topk_blocks)[:, None]
                beyond = beyond.expand_as(kept)
                sums[0] += float(kept.sum())
                sums[1] += kept.numel()
                sums[2] += float(kept[beyond].sum())
                sums[3] += int(beyond.sum())
                if answer is not None:
                    at_answer = answer[tokens].to(kept.device)
                    sums[4] += float(kept[at_answer].sum())
                    sums[5] += int(at_answer.sum()) * kept.shape[1]

    def result(self) -> List[LayerRecall]:
        return [LayerRecall(layer, kept / rows, rows, kept_beyond / rows_beyond if rows_beyond else None, rows_beyond,
                            kept_answer / rows_answer if rows_answer else None, rows_answer)
                for layer, (kept, rows, kept_beyond, rows_beyond, kept_answer, rows_answer) in sorted(self._sums.items())]


def indexer_recall(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> List[LayerRecall]:
    """Recall of each sparse layer of ``model`` (in sparse attention mode) on a fresh prefill of ``input_ids``."""
    if model.config.attention_mode != "sparse":
        raise ValueError(f"recall needs the sparse attention mode (the indexer's selections), the model is in "
                         f"{model.config.attention_mode!r} mode")
    with capture_sparse_layer_inputs(model) as captured, torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention_mask, output_page_selections=True,
                       use_cache=False, logits_to_keep=1)
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    accumulator = RecallAccumulator()
    for layer_input, selection in zip(single_pass(model, captured), output.page_selections):
        accumulator.add(layer_input, selection[real.to(selection.device)])
    return accumulator.result()
