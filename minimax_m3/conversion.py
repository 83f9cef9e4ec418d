"""transformers' checkpoint conversion mapping for ``minimax_m3``: the checkpoint's per-expert ``w1`` / ``w3`` / ``w2``
are packed into ``experts.gate_up_proj`` / ``experts.down_proj`` at load time, and unpacked by ``save_pretrained``
(transformers reverses the mapping), so saved checkpoints keep the official names."""

from __future__ import annotations

from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, MergeModulelist, PrefixChange, WeightConverter

__all__ = ["OFFICIAL_CONVERSIONS", "EXPERTS_CONVERSIONS", "register", "checkpoint_state_dict"]

OFFICIAL_CONVERSIONS = [PrefixChange(prefix_to_remove="language_model")]
"""The official release's text keys sit under ``language_model.`` (its vision tower, projector and ``mtp.`` keys are
ignored on load); transformers records the change only when a checkpoint used it, so only those models are saved
with the prefix again."""

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


def register(model_type: str) -> None:
    register_checkpoint_conversion_mapping(model_type, OFFICIAL_CONVERSIONS + EXPERTS_CONVERSIONS, overwrite=True)


def checkpoint_state_dict(model) -> dict:
    """``model``'s tensors under the checkpoint's names (per-expert ``w1`` / ``w3`` / ``w2``), as ``save_pretrained``
    writes them."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(model.state_dict()))
