"""The orchestrator's RL step as a dataflow graph of model function calls (MFCs).

    dataset (prompts, prompt_ids, answers, rows, steps, sample_seeds, policy_steps)
        │
    actor_gen      actor   = shared base + the run's broadcast adapter policy_steps
        │  tokens, loss_mask, logprobs, completions
    rew_inf        reward  = the environment's reward, advantages normalised per group
        │  rewards, advantages
    rollout_write  trainer = hands the batch to the shared trainer: rollouts/step_N

Every MFC takes a whole step (`batch_size` datapoints): advantages need every member of a
group, and the trainer takes a step's rollouts as one file. The dataset gives each datapoint
its place in the step (`rows`, group after group), the step, the seed of the step's sampling
and the broadcast step whose adapter must generate it, so each MFC is a function of its
inputs alone and can run in another process (see `rlplex.multirun.orchestrator.models`).
"""

from __future__ import annotations

from rlplex.dataflow import MFCDef, MFCGraph, ModelInterfaceType, build_graph

DATASET_KEYS = ("prompts", "prompt_ids", "answers", "rows", "steps", "sample_seeds", "policy_steps")
GENERATED_KEYS = ("tokens", "loss_mask", "logprobs", "completions")  # per datapoint, unpadded
SCORED_KEYS = ("rewards", "advantages")


def orchestrator_mfcs(batch_size: int) -> list[MFCDef]:
    """The MFCs of one orchestrator step of `batch_size` samples."""
    return [
        MFCDef(
            "actor_gen",
            "actor",
            ModelInterfaceType.GENERATE,
            ("prompt_ids", "rows", "sample_seeds", "policy_steps"),
            GENERATED_KEYS,
            batch_size,
        ),
        MFCDef(
            "rew_inf",
            "reward",
            ModelInterfaceType.INFERENCE,
            ("prompts", "answers", "completions", "rows"),
            SCORED_KEYS,
            batch_size,
        ),
        MFCDef(
            "rollout_write",
            "trainer",
            ModelInterfaceType.TRAIN_STEP,  # the shared trainer trains on what this writes
            ("tokens", "loss_mask", "logprobs", *SCORED_KEYS, "rows", "steps", "policy_steps"),
            (),
            batch_size,
        ),
    ]


def orchestrator_graph(batch_size: int) -> MFCGraph:
    return build_graph(orchestrator_mfcs(batch_size), DATASET_KEYS)
