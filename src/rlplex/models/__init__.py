"""Neural network models used by agents. The names resolve on first use (`rlplex.lazy`): a process
that reads a `ModelSpec` (the conductor, the master) does not import torch for it."""

from rlplex.lazy import lazy_getattr

__all__ = ["ActorCriticMlp", "GaussianActorCriticMlp", "QMlp", "mlp", "unwrap_model"]

__getattr__ = lazy_getattr(__name__, dict.fromkeys(__all__, "mlp"))
