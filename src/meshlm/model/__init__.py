"""Plain PyTorch Llama. Nothing here knows it may be distributed (DESIGN invariant 5)."""
from .args import PRESETS, ModelArgs
from .llama import Attention, Block, FeedForward, Llama, RMSNorm
from .init import init_tensor, materialize

__all__ = ["PRESETS", "ModelArgs", "Llama", "Block", "Attention", "FeedForward", "RMSNorm",
           "init_tensor", "materialize"]
