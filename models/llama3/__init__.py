"""LLaMA-3: model arguments and flavors, the model, and its size / FLOP counts."""

from models.llama3.flavors import FLAVORS, Llama3Args, flops_per_token, num_params
from models.llama3.model import Attention, FeedForward, RMSNorm, Transformer, TransformerBlock

__all__ = ["FLAVORS", "Attention", "FeedForward", "Llama3Args", "RMSNorm", "Transformer",
           "TransformerBlock", "flops_per_token", "num_params"]
