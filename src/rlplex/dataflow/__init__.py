"""The dataflow layer: an RL step as a graph of model function calls over a metadata buffer."""

from rlplex.dataflow.buffer import BatchMeta, BufferClosedError, SequenceBuffer
from rlplex.dataflow.mfc import GraphError, MFCDef, MFCGraph, ModelInterfaceType, build_graph, grpo_graph, ppo_graph

__all__ = [
    "BatchMeta",
    "BufferClosedError",
    "GraphError",
    "MFCDef",
    "MFCGraph",
    "ModelInterfaceType",
    "SequenceBuffer",
    "build_graph",
    "grpo_graph",
    "ppo_graph",
]
