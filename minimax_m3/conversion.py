"""transformers' checkpoint conversion mapping for ``minimax_m3``.

* The checkpoint's per-expert ``w1`` / ``w3`` / ``w2`` are packed into ``experts.gate_up_proj`` / ``experts.down_proj``
  at load time and unpacked by ``save_pretrained`` (transformers reverses the mapping), so saved checkpoints keep the
  official names.
* The official release's text keys sit under ``language_model.``; transformers records the change only when a
  checkpoint used it, so only those models are saved with the prefix again.
* transformers' native model (``minimax_m3_vl_text``) names the indexer, router and shared expert differently and
  fuses the dense ``gate_up_proj``; those names are read (``LoadOnlyRenaming`` / ``LoadOnlyConverter``) and saves
  keep the official ones.
* MXFP8 weights are dequantised by transformers' FineGrainedFP8 quantizer (``dequantize=True``, set by the config),
  which puts its dequantising op in front of these converters.
"""

from __future__ import annotations

from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import (Chunk, Concatenate, MergeModulelist, PrefixChange, WeightConverter,
                                             WeightRenaming)

__all__ = ["OFFICIAL_CONVERSIONS", "EXPERTS_CONVERSIONS", "NATIVE_CONVERSIONS", "LoadOnlyRenaming",
           "LoadOnlyConverter", "register", "checkpoint_state_dict"]


_MATCHES_NOTHING = r"(?!)"


class LoadOnlyRenaming(WeightRenaming):
    """A renaming of a foreign layout's keys, applied at load only: its reverse matches nothing, so
    ``save_pretrained`` writes the official names whatever layout the model came from."""

    def reverse_transform(self) -> WeightRenaming:
        reverse = WeightRenaming(source_patterns=_MATCHES_NOTHING, target_patterns=_MATCHES_NOTHING)
        reverse.scope_prefix, reverse.base_model_prefix = self.scope_prefix, self.base_model_prefix
        return reverse


class LoadOnlyConverter(WeightConverter):
    """A ``WeightConverter`` applied at load only (see ``LoadOnlyRenaming``)."""

    def reverse_transform(self) -> WeightRenaming:
        return LoadOnlyRenaming.reverse_transform(self)


OFFICIAL_CONVERSIONS = [PrefixChange(prefix_to_remove="language_model")]

EXPERTS_CONVERSIONS = [
    WeightConverter(
        source_patterns=[r"\.experts.*.w1.weight", r"\.experts.*.w3.weight"],
        target_patterns=r"\.experts.gate_up_proj",
        operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
    ),
    WeightConverter(
        source_patterns=r"\.experts.*.w2.weight",
        target_patterns=r"\.experts.down_proj",
        operations=[MergeModulelist(dim=0)],
    ),
]

# the Chunk sources end in "$" so that an FP8 quantizer, which adds scale sources to every ".weight" converter,
# leaves these alone (a one-to-many converter cannot take more sources)
NATIVE_CONVERSIONS = [
    LoadOnlyRenaming(r"^model\.language_model\.", "model."),
    LoadOnlyRenaming(r"self_attn\.indexer\.q_", "self_attn.index_q_"),
    LoadOnlyRenaming(r"self_attn\.indexer\.k_", "self_attn.index_k_"),
    LoadOnlyRenaming(r"mlp\.gate\.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
    LoadOnlyRenaming(r"mlp\.gate\.weight", "block_sparse_moe.gate.weight"),
    LoadOnlyRenaming(r"mlp\.experts\.", "block_sparse_moe.experts."),
    LoadOnlyRenaming(r"mlp\.shared_experts\.", "block_sparse_moe.shared_experts."),
    LoadOnlyConverter(
        source_patterns=r"shared_experts\.gate_up_proj\.weight$",
        target_patterns=[r"shared_experts.gate_proj.weight", r"shared_experts.up_proj.weight"],
        operations=[Chunk(dim=0)],
    ),
    LoadOnlyConverter(
        source_patterns=r"\.mlp\.gate_up_proj\.weight$",
        target_patterns=[r".mlp.gate_proj.weight", r".mlp.up_proj.weight"],
        operations=[Chunk(dim=0)],
    ),
]


def register(model_type: str) -> None:
    register_checkpoint_conversion_mapping(model_type, OFFICIAL_CONVERSIONS + NATIVE_CONVERSIONS + EXPERTS_CONVERSIONS,
                                           overwrite=True)


def checkpoint_state_dict(model) -> dict:
    """``model``'s tensors under the checkpoint's names (per-expert ``w1`` / ``w3`` / ``w2``), as ``save_pretrained``
    writes them."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(model.state_dict()))
