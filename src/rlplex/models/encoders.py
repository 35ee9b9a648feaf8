"""What turns an observation into the features an agent's heads read, chosen from the space.

* an image (a uint8 Box of shape (C, H, W) or (H, W, C) stacked frames, or (H, W) one grey
  frame) -> `NatureCnn`, the Nature DQN stack (conv 32 8x8/4, 64 4x4/2, 64 3x3/1, fc 512);
* a 1-D float Box -> no encoder: the MLP reads it as it is (the fast path of small agents);
* any other Box (several dimensions, or integers) -> `FlattenEncoder`, flattened to float.

Images reach the model as uint8 and are scaled to [0, 1] in the model's first op: batches and
the replay keep a quarter of a float copy's memory, and every caller (sampler, learner,
evaluator) feeds the model the same thing.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from torch import nn

from rlplex.envs import EnvSpaces, describe_observation_space
from rlplex.errors import ConfigError

EncoderKind = Literal["auto", "mlp", "cnn"]
NATURE_FEATURES = 512
# The Nature stack's receptive arithmetic: 8x8/4 then 4x4/2 then 3x3/1 need at least 36 pixels.
MIN_IMAGE_SIDE = 36


def image_layout(spaces: EnvSpaces) -> tuple[int, int, int, bool] | None:
    """(channels, height, width, channels_last) when the observation is an image, else None.

    Channels are the short axis: (4, 84, 84) is channels-first, (84, 84, 4) and (210, 160, 3)
    channels-last."""
    shape = spaces.obs_shape
    if spaces.obs_dtype != "uint8" or len(shape) not in (2, 3):
        return None
    if len(shape) == 2:
        return 1, shape[0], shape[1], False
    if shape[-1] < shape[0]:
        return shape[2], shape[0], shape[1], True
    return shape[0], shape[1], shape[2], False


def as_obs_tensor(observation: np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    """A batch of observations as the model takes it, on `device`: uint8 images as they are
    (the model scales them, and a quarter of the bytes cross to a GPU), anything else as float32."""
    if observation.dtype == np.uint8:
        return torch.as_tensor(observation, device=device)
    return torch.as_tensor(observation, dtype=torch.float32, device=device)


class NatureCnn(nn.Module):
    """uint8 frames [N, *obs_shape] -> ReLU features [N, 512]."""

    def __init__(self, channels: int, height: int, width: int, channels_last: bool, single_frame: bool) -> None:
        super().__init__()
        self.channels_last, self.single_frame = channels_last, single_frame
        self.conv = nn.Sequential(
            nn.Conv2d(channels, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            n_flat = int(self.conv(torch.zeros(1, channels, height, width)).shape[1])
        self.fc = nn.Linear(n_flat, NATURE_FEATURES)
        self.out_dim = NATURE_FEATURES
        for layer in (*self.conv, self.fc):  # SB3's NatureCNN initialisation
            if isinstance(layer, nn.Conv2d | nn.Linear) and layer.bias is not None:
                nn.init.orthogonal_(layer.weight, gain=math.sqrt(2))
                nn.init.zeros_(layer.bias)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.float() * (1.0 / 255.0)
        if self.single_frame:
            x = x.unsqueeze(1)
        elif self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return torch.relu(self.fc(self.conv(x)))


class FlattenEncoder(nn.Module):
    """[N, *obs_shape] -> float32 [N, prod(obs_shape)], uint8 scaled to [0, 1]."""

    def __init__(self, obs_shape: tuple[int, ...], scale: float) -> None:
        super().__init__()
        self.out_dim = max(1, math.prod(obs_shape))
        self.scale = scale

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.reshape(obs.shape[0], -1).float()
        return x * self.scale if self.scale != 1.0 else x


def choose_encoder(spaces: EnvSpaces, kind: EncoderKind, who: str) -> Literal["cnn", "flatten", "none"]:
    """Which encoder `spaces` gets (checks only, builds nothing); `who` names the agent (and
    algorithm) in errors."""
    layout = image_layout(spaces)
    space = describe_observation_space(spaces)
    if kind == "cnn" or (kind == "auto" and layout is not None):
        if layout is None:
            raise ConfigError(
                f"{who} with a CNN encoder needs image observations (a uint8 Box of shape (C, H, W) or (H, W, C) "
                f"stacked frames, e.g. [env.atari]), but the observation space is {space}; use encoder = 'mlp'"
            )
        height, width = layout[1:3]
        if min(height, width) < MIN_IMAGE_SIDE:
            raise ConfigError(
                f"{who}: the Nature CNN needs images of at least {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE} pixels, but the "
                f"observation space is {space}; use encoder = 'mlp' to flatten them"
            )
        return "cnn"
    return "none" if len(spaces.obs_shape) == 1 and spaces.obs_dtype == "float32" else "flatten"


def make_encoder(spaces: EnvSpaces, kind: EncoderKind, who: str) -> tuple[nn.Module | None, int]:
    """The encoder for `spaces` and the width of its features; None means the raw 1-D float
    observation is the input."""
    chosen = choose_encoder(spaces, kind, who)
    if chosen == "cnn":
        layout = image_layout(spaces)
        assert layout is not None
        cnn = NatureCnn(*layout, single_frame=len(spaces.obs_shape) == 2)
        return cnn, cnn.out_dim
    if chosen == "none":
        return None, spaces.obs_shape[0]
    flat = FlattenEncoder(spaces.obs_shape, 1.0 / 255.0 if spaces.obs_dtype == "uint8" else 1.0)
    return flat, flat.out_dim


def nature_cnn_parameters(spaces: EnvSpaces) -> int:
    """The Nature CNN's parameter count for an image space (without building it)."""
    layout = image_layout(spaces)
    assert layout is not None
    channels, height, width = layout[:3]
    for kernel, stride in ((8, 4), (4, 2), (3, 1)):
        height, width = (height - kernel) // stride + 1, (width - kernel) // stride + 1
    convs = (channels * 64 * 32 + 32) + (32 * 16 * 64 + 64) + (64 * 9 * 64 + 64)
    return convs + (64 * height * width + 1) * NATURE_FEATURES


def default_hidden(encoder: nn.Module | None) -> tuple[int, ...]:
    """Hidden widths after the encoder when the config names none: the Nature DQN's heads read
    the CNN's 512 features directly; an MLP gets two layers of 64."""
    return () if isinstance(encoder, NatureCnn) else (64, 64)
