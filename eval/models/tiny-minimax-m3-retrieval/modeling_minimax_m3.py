"""MiniMax-M3 model from the installed minimax_m3 package (the MiniMax-M3 Hopper project)."""

from minimax_m3.modeling_minimax_m3 import MiniMaxM3ForCausalLM, MiniMaxM3Model  # noqa: F401
