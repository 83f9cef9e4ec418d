"""MiniMax-M3 config from the installed minimax_m3 package (the MiniMax-M3 Hopper project)."""

from minimax_m3.configuration_minimax_m3 import MiniMaxM3Config  # noqa: F401
