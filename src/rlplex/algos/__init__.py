"""RL algorithms: PPO (on-policy) and DQN (off-policy)."""

from rlplex.algos.base import Algo
from rlplex.algos.grpo import group_advantages, grpo_loss
from rlplex.algos.ppo import PPO, PPOConfig

__all__ = ["PPO", "Algo", "PPOConfig", "group_advantages", "grpo_loss"]
