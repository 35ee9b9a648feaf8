"""n-step transitions assembled at sample time from the one-step ones a replay stores.

From a sampled slot i the chain follows the same environment's next steps, `stride` slots
apart (a time-major [T, B] append puts them B apart). It stops early, at k < n steps, where

- the episode ended (`done`: terminated or truncated) at the last step taken: after a
  termination nothing is bootstrapped, after a truncation the bootstrap uses the final
  observation the slot kept;
- the next slot is not the next step: its `serial` is not k * stride past slot i's (not yet
  written, or overwritten by the ring). Every runner appends each environment's steps in order
  (AsyncRl's copiers take turns), so a slot k * stride later is the same environment's.

So every result is an exact k-step transition: `reward` = sum_{j<k} gamma^j r_{i+j},
`next_observation` and `terminated` are those of step k-1 and `discount` = gamma^k.
"""

from __future__ import annotations

import numpy as np

OUT_FIELDS = ("observation", "action", "reward", "next_observation", "terminated", "discount")


def nstep_transitions(
    arrays: dict[str, np.ndarray], idx: np.ndarray, n_step: int, gamma: float, stride: int
) -> dict[str, np.ndarray]:
    """The n-step transitions starting at slots `idx` (vectorised over the batch)."""
    capacity = len(arrays["reward"])
    reward = arrays["reward"][idx].astype(np.float64)
    discount = np.full(len(idx), gamma, dtype=np.float64)
    last = idx.copy()
    alive = np.ones(len(idx), dtype=bool)
    serial0 = arrays["serial"][idx]
    obs, next_obs = arrays["observation"], arrays["next_observation"]
    for k in range(1, n_step):
        j = (idx + k * stride) % capacity
        alive &= ~arrays["done"][last] & (arrays["serial"][j] == serial0 + k * stride)
        if not alive.any():
            break
        reward += np.where(alive, gamma**k * arrays["reward"][j], 0.0)
        discount[alive] = gamma ** (k + 1)
        last = np.where(alive, j, last)
    return {
        "observation": obs[idx],
        "action": arrays["action"][idx],
        "reward": reward.astype(np.float32),
        "next_observation": next_obs[last],
        "terminated": arrays["terminated"][last],
        "discount": discount.astype(np.float32),
    }
