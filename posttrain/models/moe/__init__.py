"""Mixture-of-Experts layer: top-k router, dropless grouped-matmul experts, expert-parallel dispatch."""

from posttrain.models.moe.layer import MoE
from posttrain.models.moe.router import RouterBias

__all__ = ["MoE", "RouterBias"]
