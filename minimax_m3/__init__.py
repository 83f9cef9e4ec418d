"""Hugging Face-style MiniMax-M3 whose sparse attention layers run on ``indexer``.

Importing registers the ``minimax_m3`` model type with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM``. (``minimax_m3_vl*`` belong to transformers and are not registered here.)
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import conversion
from .cache import MiniMaxM3Cache, MiniMaxM3StaticCache
from .configuration_minimax_m3 import MiniMaxM3Config
from .loading import load_model
from .modeling_minimax_m3 import MiniMaxM3ForCausalLM, MiniMaxM3Model, MiniMaxM3PreTrainedModel

AutoConfig.register(MiniMaxM3Config.model_type, MiniMaxM3Config, exist_ok=True)
AutoModel.register(MiniMaxM3Config, MiniMaxM3Model, exist_ok=True)
AutoModelForCausalLM.register(MiniMaxM3Config, MiniMaxM3ForCausalLM, exist_ok=True)
conversion.register(MiniMaxM3Config.model_type)

__all__ = ["MiniMaxM3Config", "MiniMaxM3Model", "MiniMaxM3ForCausalLM", "MiniMaxM3PreTrainedModel", "MiniMaxM3Cache", "MiniMaxM3StaticCache",
           "load_model"]
