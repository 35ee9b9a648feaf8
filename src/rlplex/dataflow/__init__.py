"""The dataflow layer: an RL step as a graph of model function calls over a metadata buffer."""

from rlplex.dataflow.buffer import BatchMeta, BufferClosedError, SequenceBuffer
from rlplex.dataflow.dataplane import DataPlane, LocalTensorStore, TensorStore
from rlplex.dataflow.executor import DatasetExhaustedError, FunctionExecutor, MFCExecutionError
from rlplex.dataflow.job_worker import JobModelWorker, ModelWorkerNode
from rlplex.dataflow.mfc import GraphError, MFCDef, MFCGraph, ModelInterfaceType, build_graph, grpo_graph, ppo_graph
from rlplex.dataflow.process_worker import ModelServer, ProcessModelWorker
from rlplex.dataflow.stream import (
    RolloutWorker,
    StalenessController,
    StreamClosedError,
    StreamDataset,
    Trajectory,
    WaitCounters,
    WeightBroadcaster,
)
from rlplex.dataflow.workers import LocalModelWorker, ModelInterface, ModelWorker

__all__ = [
    "BatchMeta",
    "BufferClosedError",
    "DataPlane",
    "DatasetExhaustedError",
    "FunctionExecutor",
    "GraphError",
    "JobModelWorker",
    "LocalModelWorker",
    "LocalTensorStore",
    "MFCDef",
    "MFCExecutionError",
    "MFCGraph",
    "ModelInterface",
    "ModelInterfaceType",
    "ModelServer",
    "ModelWorker",
    "ModelWorkerNode",
    "ProcessModelWorker",
    "RolloutWorker",
    "SequenceBuffer",
    "StalenessController",
    "StreamClosedError",
    "StreamDataset",
    "TensorStore",
    "Trajectory",
    "WaitCounters",
    "WeightBroadcaster",
    "build_graph",
    "grpo_graph",
    "ppo_graph",
]
