"""`rlplex export`: a run's adapter out of its folder, as peft loads it and merged into the base.

The run folder is real (an orchestrator's `orch.toml`, the trainer's PEFT-layout broadcasts)
and the base is the untrained tiny checkpoint; peft, transformers and the CLI are the real
ones. The real job's broadcast is exported in the main job's end-to-end test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mr_helpers import new_run
from typer.testing import CliRunner

from lm_models import untrained_tiny_model
from rlplex.cli import app
from rlplex.multirun.rundir.peft_export import write_peft_adapter
from rlplex.multirun.trainer.lora_apply import DEFAULT_TARGET_MODULES

RANK, ALPHA = 4, 8.0


def _base() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(untrained_tiny_model()).eval()


def _random_adapter(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in DEFAULT_TARGET_MODULES:
            out_features, in_features = module.weight.shape
            state[f"{name}.lora_A.weight"] = torch.randn(RANK, in_features, generator=generator) * 0.3
            state[f"{name}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator) * 0.3
    return state


@pytest.fixture
def job_folder(tmp_path: Path) -> Path:
    """A main job's folder with run_x: adapters of steps 1 and 2 broadcast, as the trainer writes them."""
    out = tmp_path / "job"
    (out / "runs").mkdir(parents=True)
    run = new_run(out / "runs", "run_x", model={"lora": {"rank": RANK, "alpha": ALPHA}})
    base = _base()
    for step in (1, 2):
        write_peft_adapter(
            run.broadcast / f"step_{step}",
            _random_adapter(base, seed=step),
            str(untrained_tiny_model()),
            RANK,
            ALPHA,
            DEFAULT_TARGET_MODULES,
            "CAUSAL_LM",
        )
    return out


def _export(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["export", *args])
    return result.exit_code, " ".join(result.output.split())


def test_the_newest_adapter_exports_for_peft_and_merged_and_both_give_the_adapted_logits(
    job_folder: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, said = _export(str(job_folder), "run_x", str(tmp_path / "adapter"))
    assert code == 0 and said == f"run_x step 2: PEFT adapter written to {tmp_path / 'adapter'}", said
    (tmp_path / "merged").mkdir()  # an empty folder may be the destination
    code, said = _export(str(job_folder), "x", str(tmp_path / "merged"), "--merge")
    assert code == 0 and said.startswith("run_x step 2: merged model written"), said
    assert not list(tmp_path.glob(".*tmp-*")), "no half-written folder is left beside the destination"

    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == RANK
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "adapter")
    tokens = torch.tensor([tokenizer.encode("r:abcdef>")])
    with torch.no_grad():
        plain = _base()(tokens).logits
        with_peft = PeftModel.from_pretrained(_base(), str(tmp_path / "adapter")).eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").encode("r:abcdef>") == tokens[0].tolist()
    torch.testing.assert_close(merged, with_peft, rtol=1e-4, atol=1e-4)
    assert (with_peft - plain).abs().max() > 1e-2, "the adapter must change the logits for this test to mean anything"


def test_an_older_step_exports_on_request(job_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    code, said = _export(str(job_folder), "run_x", str(tmp_path / "one"), "--step", "1")
    assert code == 0 and said.startswith("run_x step 1:"), said
    exported = load_file(tmp_path / "one" / "adapter_model.safetensors")
    broadcast = load_file(job_folder / "runs" / "run_x" / "broadcast" / "step_1" / "adapter_model.safetensors")
    assert exported.keys() == broadcast.keys() and all(torch.equal(exported[k], broadcast[k]) for k in exported)


def test_each_mistake_is_one_line_naming_what_is_there(job_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    broadcast = job_folder / "runs" / "run_x" / "broadcast"
    cases = {
        ("run_y", "new"): f"error: {job_folder}: no run 'run_y' (runs there: run_x)",
        ("run_x", "taken"): f"error: {tmp_path / 'taken'}: already exists and is not an empty folder; name a new one",
        ("run_x", "new", "--step", "7"): f"error: {broadcast}: no complete adapter of step 7 (steps there: 1, 2)",
    }
    for (run_id, dest, *rest), expected in cases.items():
        code, said = _export(str(job_folder), run_id, str(tmp_path / dest), *rest)
        assert (code, said) == (2, expected)
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "new").exists()

    (broadcast / "step_2" / "STABLE").unlink()  # a step being written is not taken
    (broadcast / "step_1" / "STABLE").unlink()
    code, said = _export(str(job_folder), "run_x", str(tmp_path / "new"))
    assert (code, said) == (2, f"error: {broadcast}: no complete adapter yet (the run has not trained a step)")
