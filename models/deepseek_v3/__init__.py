"""DeepSeek-V3: model arguments and flavors, the model (MLA attention, MoE with routed + shared
experts, aux-loss-free load balancing), and its size / FLOP counts."""

from models.deepseek_v3.flavors import FLAVORS, DeepSeekV3Args, flops_per_token, num_params
from models.deepseek_v3.model import (
    Attention,
    DeepSeekV3,
    GroupedExperts,
    LocalTokenDispatcher,
    MoE,
    Router,
    TransformerBlock,
)

__all__ = ["FLAVORS", "Attention", "DeepSeekV3", "DeepSeekV3Args", "GroupedExperts", "LocalTokenDispatcher",
           "MoE", "Router", "TransformerBlock", "flops_per_token", "num_params"]
