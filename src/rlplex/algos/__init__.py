"""RL algorithms: PPO and A2C (on-policy), DQN, R2D1 (recurrent), SAC and TD3/DDPG (off-policy), GRPO."""

from rlplex.algos.a2c import A2C, A2CConfig
from rlplex.algos.base import Algo
from rlplex.algos.dqn import DQN, DQNConfig
from rlplex.algos.grpo import grpo_loss
from rlplex.algos.ppo import PPO, PPOConfig
from rlplex.algos.r2d1 import R2D1, R2D1Config
from rlplex.algos.rl_math import clipped_surrogate, gae, group_advantages
from rlplex.algos.sac import SAC, SACConfig
from rlplex.algos.td3 import TD3, DDPGConfig, TD3Config

__all__ = [
    "A2C",
    "DQN",
    "PPO",
    "R2D1",
    "SAC",
    "TD3",
    "A2CConfig",
    "Algo",
    "DDPGConfig",
    "DQNConfig",
    "PPOConfig",
    "R2D1Config",
    "SACConfig",
    "TD3Config",
    "clipped_surrogate",
    "gae",
    "group_advantages",
    "grpo_loss",
]
