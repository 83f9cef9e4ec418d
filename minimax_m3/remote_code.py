"""An ``auto_map`` in saved checkpoints that points at this installed package, so transformers' Auto classes (and
tools built on them, such as lm-eval's ``hf`` model) load a checkpoint with ``trust_remote_code=True`` without
``import minimax_m3`` — offline: the two modules written beside the weights only import the installed package.
Without ``trust_remote_code`` (and without the import) transformers says to pass it, instead of not recognising
the model type."""

from __future__ import annotations

import json
import os

from .command_line import atomic_write

__all__ = ["AUTO_MAP", "write_remote_code"]

AUTO_MAP = {
    "AutoConfig": "configuration_minimax_m3.MiniMaxM3Config",
    "AutoModel": "modeling_minimax_m3.MiniMaxM3Model",
    "AutoModelForCausalLM": "modeling_minimax_m3.MiniMaxM3ForCausalLM",
}

_MODULES = {
    "configuration_minimax_m3.py": (
        '"""MiniMax-M3 config from the installed minimax_m3 package (the MiniMax-M3 Hopper project)."""\n\n'
        "from minimax_m3.configuration_minimax_m3 import MiniMaxM3Config  # noqa: F401\n"
    ),
    "modeling_minimax_m3.py": (
        '"""MiniMax-M3 model from the installed minimax_m3 package (the MiniMax-M3 Hopper project)."""\n\n'
        "from minimax_m3.modeling_minimax_m3 import MiniMaxM3ForCausalLM, MiniMaxM3Model  # noqa: F401\n"
    ),
}


def _write_text(path: str, text: str) -> None:
    atomic_write(path, lambda temporary: temporary.write_text(text))


def write_remote_code(directory: str) -> None:
    """Write the two import modules into a saved checkpoint ``directory`` and add ``auto_map`` to its config."""
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    for name, text in _MODULES.items():
        _write_text(os.path.join(directory, name), text)
    config["auto_map"] = dict(AUTO_MAP)
    _write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
