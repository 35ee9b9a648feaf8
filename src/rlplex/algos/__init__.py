"""RL algorithms: PPO (on-policy) and DQN (off-policy)."""

from rlplex.algos.base import Algo
from rlplex.algos.dqn import DQN, DQNConfig
from rlplex.algos.grpo import group_advantages, grpo_loss
from rlplex.algos.ppo import PPO, PPOConfig

__all__ = ["DQN", "PPO", "Algo", "DQNConfig", "PPOConfig", "group_advantages", "grpo_loss"]
