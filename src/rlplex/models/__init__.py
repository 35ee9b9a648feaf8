"""Neural network models used by agents."""

from rlplex.models.mlp import ActorCriticMlp, GaussianActorCriticMlp, QMlp, mlp, unwrap_model

__all__ = ["ActorCriticMlp", "GaussianActorCriticMlp", "QMlp", "mlp", "unwrap_model"]
