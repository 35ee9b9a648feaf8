"""RL algorithms: PPO (on-policy) and DQN (off-policy)."""

from rlplex.algos.base import Algo
from rlplex.algos.dqn import DQN, DQNConfig
from rlplex.algos.ppo import PPO, PPOConfig

__all__ = ["DQN", "PPO", "Algo", "DQNConfig", "PPOConfig"]
