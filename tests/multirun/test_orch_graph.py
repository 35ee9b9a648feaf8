"""The orchestrator's dataflow: its graph, and its three models run on real tensors and files.

The end-to-end path (a real orchestrator process going through the executor) is covered in
`test_orchestrator.py`, which checks the per-MFC timing columns in progress.csv.
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from lm_models import small_tiny_model
from rlplex.dataflow import MFCExecutionError, ModelInterfaceType, ProcessModelWorker, build_graph
from rlplex.models.hf import load_causal_lm, load_tokenizer
from rlplex.models.lm import generate, pad_id_of
from rlplex.multirun import OrchestratorConfig, apply_multi_lora, create_run, write_peft_adapter
from rlplex.multirun.orchestrator.graph import DATASET_KEYS, orchestrator_graph, orchestrator_mfcs
from rlplex.multirun.orchestrator.loop import StepDataflow
from rlplex.multirun.orchestrator.models import ActorModel, EnvRewardModel, RolloutHandoff, StepPrompts
from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.rollouts import read_rollouts, rollouts_ready
from rlplex.tasks import Example, load_environment

BATCH, GROUP = 16, 4
TARGETS = ("q_proj", "v_proj")


def make_config(**overrides: object) -> OrchestratorConfig:
    data: dict[str, object] = {
        "env": {"name": "reverse"},
        "max_steps": 2,
        "batch_size": BATCH,
        "group_size": GROUP,
        "model": {"name": str(small_tiny_model()), "lora": {"rank": 4, "alpha": 8.0}},
    }
    data.update(overrides)
    return OrchestratorConfig.model_validate(data)


def test_graph_keys_order_and_batch() -> None:
    graph = build_graph(orchestrator_mfcs(BATCH), DATASET_KEYS)
    assert [m.name for m in graph.mfcs] == ["actor_gen", "rew_inf", "rollout_write"]
    assert graph.dataset_keys == DATASET_KEYS
    assert graph.parents == {"actor_gen": (), "rew_inf": ("actor_gen",), "rollout_write": ("actor_gen", "rew_inf")}
    assert [m.name for m in graph.final_mfcs] == ["rollout_write"]
    assert {graph.producer[k] for k in ("tokens", "loss_mask", "logprobs", "completions")} == {"actor_gen"}
    assert {graph.producer[k] for k in ("rewards", "advantages")} == {"rew_inf"}
    assert [(m.model_name, m.interface_type) for m in graph.mfcs] == [
        ("actor", ModelInterfaceType.GENERATE),
        ("reward", ModelInterfaceType.INFERENCE),
        ("trainer", ModelInterfaceType.TRAIN_STEP),
    ]
    # A whole step per call: advantages need whole groups, the trainer one file per step.
    assert {m.n_seqs for m in orchestrator_graph(BATCH).mfcs} == {BATCH}
    # Every produced key is read by someone: nothing is generated for nothing.
    read = {key for m in graph.mfcs for key in m.input_keys}
    assert set(graph.all_keys) <= read


def test_prompts_are_seeded_by_seed_step_and_attempt() -> None:
    config, task = make_config(), load_environment("reverse")
    tokenizer = load_tokenizer(config.model)

    def draw(step: int, attempt: int, seed_config: OrchestratorConfig = config) -> list[dict[str, Any]]:
        dataset = StepPrompts(task, tokenizer, seed_config)
        dataset.prepare(step, attempt, policy_step=3)
        return [next(dataset) for _ in range(BATCH)]

    first = draw(1, 0)
    assert first == draw(1, 0)
    assert [item["rows"] for item in first] == list(range(BATCH))
    assert {(item["steps"], item["policy_steps"]) for item in first} == {(1, 3)}
    assert len({item["sample_seeds"] for item in first}) == 1
    for group in range(BATCH // GROUP):  # group after group, one prompt per group
        assert len({item["prompts"] for item in first[group * GROUP : (group + 1) * GROUP]}) == 1
    assert first != draw(1, 1) and first != draw(2, 0) and first != draw(1, 0, make_config(seed=1))
    dataset = StepPrompts(task, tokenizer, config)
    with pytest.raises(MFCExecutionError, match="prepare"):
        next(dataset)


@pytest.fixture
def actor_run(tmp_path: Path) -> tuple[OrchestratorConfig, RunDir, ActorModel]:
    """A run with a random adapter at broadcast/step_0 and the actor built from its files."""
    config = make_config()
    run = create_run(tmp_path, "run_g", config)
    model = copy.deepcopy(load_causal_lm(config.model))
    lora = apply_multi_lora(model, target_modules=TARGETS, rank=4, n_adapters=1)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, param in lora.named_parameters_for_adapter(0):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    write_peft_adapter(
        run.broadcast_step(0), lora.adapter_state_dict(0), config.model.name, rank=4, alpha=8.0, target_modules=TARGETS
    )
    return config, run, ActorModel.for_run(tmp_path, "run_g", config)


def _columns(items: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list[Any]]:
    return {key: [item[key] for item in items] for key in keys}


def _run_step(
    config: OrchestratorConfig, run: RunDir, actor: ActorModel, shards: int, shuffle: bool
) -> tuple[RolloutHandoff, list[dict[str, Any]]]:
    """One step by hand: actor_gen on `shards` workers' shares, then rew_inf and rollout_write
    on the datapoints in a shuffled order (as if the buffer handed them over any way)."""
    graph = orchestrator_graph(BATCH)
    dataset = StepPrompts(load_environment(config.env), actor.tokenizer, config)
    dataset.prepare(0, 0, policy_step=0)
    items = [next(dataset) for _ in range(BATCH)]
    for shard in range(shards):
        share = items[shard::shards]  # split_by_count
        outputs = actor.generate(graph.get("actor_gen"), _columns(share, graph.get("actor_gen").input_keys))
        for position, item in enumerate(share):
            item.update({key: values[position] for key, values in outputs.items()})
    if shuffle:
        random.Random(0).shuffle(items)
    rew = graph.get("rew_inf")
    reward = EnvRewardModel(load_environment(config.env), config.group_size)
    scored = reward.inference(rew, _columns(items, rew.input_keys))
    for position, item in enumerate(items):
        item.update({key: values[position] for key, values in scored.items()})
    handoff = RolloutHandoff(run, pad_id_of(actor.tokenizer))
    write = graph.get("rollout_write")
    assert handoff.train_step(write, _columns(items, write.input_keys)) == {}
    return handoff, items


def test_one_worker_writes_exactly_what_generate_gives(
    actor_run: tuple[OrchestratorConfig, RunDir, ActorModel],
) -> None:
    config, run, actor = actor_run
    handoff, items = _run_step(config, run, actor, shards=1, shuffle=True)
    assert handoff.last is not None and handoff.last.written and rollouts_ready(run, 0)
    batch = read_rollouts(run, 0, vocab_size=len(actor.tokenizer))
    assert (batch.step, batch.policy_step, batch.n) == (0, 0, BATCH)
    # The layout the orchestrator wrote before its step was a dataflow: one generate call.
    ordered = sorted(items, key=lambda item: item["rows"])
    generator = torch.Generator().manual_seed(ordered[0]["sample_seeds"])
    with actor.engine.policy.active(BATCH) as model:  # type: ignore[attr-defined]  # the HFEngine
        prompts = [i["prompt_ids"] for i in ordered]
        direct = generate(model, actor.tokenizer, prompts, actor.max_new_tokens, 1.0, generator)
    assert torch.equal(batch.tokens, direct.tokens_B_L)
    assert torch.equal(batch.attention, direct.attention_B_L)
    assert torch.equal(batch.loss_mask, direct.completion_mask_B_L)
    assert torch.equal(batch.logprobs, direct.logprobs_B_L.float())
    env = load_environment(config.env)
    expected = env.score([Example(prompt=i["prompts"], answer=i["answers"]) for i in ordered], direct.completions)
    assert batch.rewards.tolist() == pytest.approx(expected)
    grouped = batch.advantages.view(-1, GROUP)
    assert torch.allclose(grouped.mean(dim=1), torch.zeros(BATCH // GROUP), atol=1e-5)
    assert handoff.last.generated_tokens == int(direct.completion_mask_B_L.sum())


def test_rows_of_several_workers_merge_into_one_valid_batch(
    actor_run: tuple[OrchestratorConfig, RunDir, ActorModel],
) -> None:
    config, run, actor = actor_run
    handoff, items = _run_step(config, run, actor, shards=3, shuffle=True)
    assert handoff.last is not None and handoff.last.written
    batch = read_rollouts(run, 0, vocab_size=len(actor.tokenizer))  # validated: shapes, masks, values
    ordered = sorted(items, key=lambda item: item["rows"])
    for row, item in enumerate(ordered):
        keep = batch.attention[row].bool()
        assert torch.equal(batch.tokens[row][keep], item["tokens"])
        assert torch.equal(batch.loss_mask[row][keep], item["loss_mask"])
        assert torch.equal(batch.logprobs[row][keep], item["logprobs"])
        assert float(batch.rewards[row]) == float(item["rewards"])
    # Shards draw different samples: offsetting the seed keeps them from repeating each other.
    assert len({tuple(i["tokens"].tolist()) for i in ordered}) > BATCH // GROUP


def test_reward_refuses_partial_groups() -> None:
    config = make_config()
    rew = orchestrator_graph(BATCH).get("rew_inf")
    model = EnvRewardModel(load_environment(config.env), GROUP)
    inputs = {"prompts": ["r:ab>"] * 3, "answers": ["ba"] * 3, "completions": ["ba"] * 3, "rows": [0, 1, 2]}
    with pytest.raises(MFCExecutionError, match=r"rows \[0, 1, 2\] are not one whole group of 4"):
        model.inference(rew, inputs)


def test_no_learning_signal_writes_nothing(actor_run: tuple[OrchestratorConfig, RunDir, ActorModel]) -> None:
    config, run, actor = actor_run
    actor.config = make_config(temperature=0.0)  # greedy: every completion of a group is the same
    handoff, _ = _run_step(config, run, actor, shards=1, shuffle=False)
    assert handoff.last is not None and not handoff.last.written
    assert not rollouts_ready(run, 0) and not run.rollout_step(0).exists()


@pytest.mark.slow
def test_rollout_workers_generate_in_processes_of_their_own(
    tmp_path: Path, actor_run: tuple[OrchestratorConfig, RunDir, ActorModel]
) -> None:
    _, run, local_actor = actor_run
    config = make_config(rollout_workers=2)
    with StepDataflow(tmp_path, run, config, load_environment(config.env)) as dataflow:
        actors = dataflow.workers["actor"]
        assert [type(w) for w in actors] == [ProcessModelWorker, ProcessModelWorker]
        pids = {w.process.pid for w in actors}  # type: ignore[attr-defined]
        assert len(pids) == 2 and os.getpid() not in pids
        handoff, timings = dataflow.run_step(0, 0, policy_step=0)
        assert handoff.written and timings["timings/actor_gen_run_s"] > 0
    assert all(not w.process.is_alive() for w in actors)  # type: ignore[attr-defined]
    batch = read_rollouts(run, 0, vocab_size=len(local_actor.tokenizer))
    # Worker k generated rows k, k+2, ...: what the same actor gives for that share in process.
    dataset = StepPrompts(load_environment(config.env), local_actor.tokenizer, config)
    dataset.prepare(0, 0, policy_step=0)
    items = [next(dataset) for _ in range(BATCH)]
    mfc = orchestrator_graph(BATCH).get("actor_gen")
    for shard in range(2):
        share = items[shard::2]
        expected = local_actor.generate(mfc, _columns(share, mfc.input_keys))
        for position, item in enumerate(share):
            keep = batch.attention[item["rows"]].bool()
            assert torch.equal(batch.tokens[item["rows"]][keep], expected["tokens"][position])
            assert torch.equal(batch.logprobs[item["rows"]][keep], expected["logprobs"][position])
