"""`[trainer] target_modules` with the output head: the shared trainer trains an `lm_head`
adapter beside the projections, and what it broadcasts samples the same in the orchestrator's
engine (`AdapterPolicy`) and in peft."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from mr_train_helpers import base_model, broadcast_weights, make_trainer, new_train_run, train_until, write_synthetic

from rlplex.multirun.orchestrator.policy import AdapterPolicy, read_peft_adapter
from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.peft_export import read_peft_adapter as adapter_tensors

TARGETS = ("q_proj", "v_proj", "down_proj", "lm_head")


def test_an_output_head_adapter_trains_and_samples_the_same_in_the_engine_and_in_peft(tmp_path: Path) -> None:
    from peft import PeftModel

    new_train_run(tmp_path, "run_h", optim={"lr": 0.01})
    write_synthetic(tmp_path, "run_h", range(2))
    trainer = make_trainer(tmp_path, 1, target_modules=TARGETS)
    train_until(trainer, {"run_h": 2})
    broadcast = RunDir(tmp_path, "run_h").broadcast_step(2)
    adapter = read_peft_adapter(broadcast)
    assert sorted(adapter.target_modules) == sorted(TARGETS)
    head = broadcast_weights(tmp_path, "run_h", 2)["base_model.model.lm_head.lora_B.weight"]
    assert head.abs().max() > 0, "the output head's adapter did not train"

    tokens = torch.randint(3, 60, (3, 9), generator=torch.Generator().manual_seed(2))
    idx = trainer.manager.id_2_idx["run_h"]
    policy = AdapterPolicy(copy.deepcopy(base_model()), max_rank=8)
    policy.load(broadcast, step=2)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base_model()), str(broadcast)).eval()
    device = next(trainer.model.parameters()).device
    with torch.no_grad():
        with trainer.manager.active_adapters(torch.full((3,), idx, dtype=torch.long)):
            trained = trainer.model(input_ids=tokens.to(device)).logits.cpu()
        with policy.active(3) as model:
            sampled = model(input_ids=tokens).logits
        expected = peft_model(input_ids=tokens).logits
        plain = base_model()(input_ids=tokens).logits
    torch.testing.assert_close(sampled, trained, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(expected, trained, rtol=1e-4, atol=1e-4)
    assert (trained - plain).abs().max() > 1e-3, "the adapter must change the logits for this test to mean anything"

    # Merged (`rlplex export --merged`): the tied head gets weights of its own, the input
    # embeddings stay the base's, and the saved model reloads with the adapted logits.
    from rlplex.models.hf import load_causal_lm
    from rlplex.models.spec import ModelSpec
    from rlplex.multirun.export import merge_adapter

    merged = copy.deepcopy(base_model())
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight  # tied, as the test needs
    merge_adapter(merged, adapter_tensors(broadcast), adapter.alpha / adapter.rank)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = load_causal_lm(ModelSpec(name=str(tmp_path / "merged"), dtype="float32"), torch.device("cpu")).eval()
    with torch.no_grad():
        got = reloaded(input_ids=tokens).logits
    torch.testing.assert_close(reloaded.get_input_embeddings().weight, base_model().get_input_embeddings().weight)
    torch.testing.assert_close(got, trained, rtol=1e-4, atol=1e-4)
