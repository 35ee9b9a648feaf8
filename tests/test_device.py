"""`runner.device`: where the model, its training batches and the serial sampler's acting live.

Without a GPU the CUDA tests are skipped and the CPU-side contract is checked (auto is the
CPU, cuda is a user error naming the field, nccl needs the model on a GPU). On a GPU machine
`pytest tests/test_device.py` trains every algorithm on CUDA, resumes it, and runs SyncRl on
nccl and AsyncRl with a CUDA learner.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from rlplex.cli import app
from rlplex.envs import probe_spaces
from rlplex.errors import ConfigError, DeviceError
from rlplex.io.snapshot import latest_snapshot
from rlplex.models.device import model_device, resolve_device, to_numpy, to_tensor
from rlplex.runners.config import TrainConfig, build_rank_runner, build_runner, cpu_advice, load_train_config

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
without_cuda = pytest.mark.skipif(CUDA, reason="checks what a machine without a GPU answers")


def example(name: str, **edits: dict[str, Any]) -> TrainConfig:
    """An example's config with some sections' fields replaced."""
    data = load_train_config(ROOT / "examples" / name).model_dump()
    for section, fields in edits.items():
        data[section].update(fields)
    return TrainConfig.model_validate(data)


# ----- everywhere ----------------------------------------------------------------------------
@without_cuda
def test_auto_is_the_cpu_and_cuda_is_an_error_naming_the_field() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu", index=3) == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"field 'runner.device': 'cuda' was asked for, but .* sees no CUDA"):
        resolve_device("cuda", "runner.device")
    with pytest.raises(DeviceError, match=r"field 'device': 'tpu' is not one of"):
        resolve_device("tpu")


def test_model_device_follows_a_move_and_tensors_cross_the_numpy_boundary() -> None:
    model = nn.Linear(3, 2)
    assert model_device(model) == torch.device("cpu")
    model.to(torch.float64)  # `Module.to` keeps the tensor objects the lookup remembers
    assert model.weight.dtype == torch.float64 and model_device(model) == torch.device("cpu")
    assert model_device(nn.Module()) == torch.device("cpu")  # no tensors at all (RandomAgent's model)
    array = to_numpy(to_tensor([[1.0, 2.0]], model_device(model), torch.float32))
    assert array.dtype.name == "float32" and array.tolist() == [[1.0, 2.0]]


@without_cuda
def test_train_with_device_cuda_on_a_machine_without_a_gpu_exits_2_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "cuda.toml"
    text = (ROOT / "examples" / "cartpole_ppo.toml").read_text()
    config.write_text(text.replace("[runner]", '[runner]\ndevice = "cuda"'))
    result = CliRunner().invoke(app, ["train", str(config), "--output", str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "runner.device" in result.output and "cuda" in result.output
    assert not (tmp_path / "out" / "snapshots").exists()  # refused before anything ran

    example_file = str(ROOT / "examples" / "cartpole_ppo.toml")
    flag = CliRunner().invoke(app, ["train", example_file, "--device", "cuda", "--output", str(tmp_path / "flag")])
    assert flag.exit_code == 2 and "runner.device" in flag.output, flag.output
    typo = CliRunner().invoke(app, ["train", example_file, "--device", "gpu", "--output", str(tmp_path / "typo")])
    assert typo.exit_code == 2 and "runner.device" in typo.output and "gpu" in typo.output, typo.output


def test_nccl_with_the_model_on_the_cpu_is_refused_before_any_rank_starts() -> None:
    config = example("cartpole_ppo.toml", runner={"kind": "sync", "backend": "nccl", "device": "cpu"})
    with pytest.raises(ConfigError, match=r"field 'runner.backend': 'nccl' needs the model on a GPU"):
        build_runner(config, None, show_progress=False)


def test_the_runner_takes_its_device_from_the_config(tmp_path: Path) -> None:
    config = example("cartpole_ppo.toml", runner={"device": "cpu", "n_steps": 256})
    runner = build_rank_runner(config, tmp_path, show_progress=False)
    assert runner.device == torch.device("cpu")
    runner.train()
    assert model_device(runner.agent.model) == torch.device("cpu")


def test_an_mlp_policy_gradient_put_on_a_gpu_by_auto_gets_the_advice_to_use_the_cpu() -> None:
    cuda = torch.device("cuda")  # only compared, never allocated: no GPU needed
    ppo = example("cartpole_ppo.toml")
    spaces = probe_spaces(ppo.env)
    advice = cpu_advice(ppo, spaces, cuda)
    assert advice is not None and "--device cpu" in advice
    assert cpu_advice(ppo, spaces, torch.device("cpu")) is None
    chosen = example("cartpole_ppo.toml", runner={"device": "cuda"})
    assert cpu_advice(chosen, spaces, cuda) is None  # asked for: the user knows
    dqn = example("cartpole_dqn_full.toml")
    assert cpu_advice(dqn, probe_spaces(dqn.env), cuda) is None  # replay updates of 64 x 128 use a GPU well


# ----- on a GPU --------------------------------------------------------------------------------
CUDA_CASES = [
    ("cartpole_ppo.toml", {"runner": {"n_steps": 1024, "log_interval_steps": 512}}),
    ("cartpole_a2c.toml", {"runner": {"n_steps": 800, "log_interval_steps": 400}}),
    ("cartpole_dqn_full.toml", {"algo": {"learning_starts": 256}, "runner": {"n_steps": 1024}}),
    ("cartpole_c51.toml", {"algo": {"learning_starts": 256}, "runner": {"n_steps": 1024}}),
    ("pendulum_sac.toml", {"algo": {"learning_starts": 100}, "runner": {"n_steps": 400}}),
    ("pendulum_td3.toml", {"algo": {"learning_starts": 100}, "runner": {"n_steps": 400}}),
    ("cartpole_novel_ppo_lstm.toml", {"runner": {"n_steps": 1024}}),
    ("cartpole_novel_r2d1.toml", {"runner": {"n_steps": 2100}}),
]


@needs_cuda
@pytest.mark.parametrize(("name", "edits"), CUDA_CASES, ids=[name for name, _ in CUDA_CASES])
def test_every_algorithm_trains_and_resumes_on_cuda(name: str, edits: dict[str, Any], tmp_path: Path) -> None:
    edits = {**edits, "runner": {**edits.get("runner", {}), "device": "cuda", "stop_at_return": None}}
    config = example(name, **edits)
    runner = build_rank_runner(config, tmp_path, show_progress=False)
    result = runner.train()
    assert model_device(runner.agent.model).type == "cuda"
    for critic in ("critic", "target"):  # what the off-policy algorithms keep beside the agent
        if hasattr(runner.algo, critic):
            assert model_device(getattr(runner.algo, critic)).type == "cuda"
    losses = {k: v for row in result.history for k, v in row.items() if k.startswith("losses/")}
    assert losses and all(math.isfinite(v) for v in losses.values()), losses

    longer = example(name, **{**edits, "runner": {**edits["runner"], "n_steps": 2 * config.runner.n_steps}})
    resumed = build_rank_runner(longer, tmp_path, show_progress=False)
    snapshot = latest_snapshot(tmp_path / "snapshots")
    assert snapshot is not None
    resumed.resume_from(snapshot)
    again = resumed.train()
    assert again.env_steps > result.env_steps and model_device(resumed.agent.model).type == "cuda"


@needs_cuda
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_sync_ranks_train_on_their_gpus(backend: str, tmp_path: Path) -> None:
    world = min(2, torch.cuda.device_count()) if backend == "nccl" else 2  # nccl: one rank a GPU
    config = example(
        "cartpole_ppo.toml",
        runner={"kind": "sync", "backend": backend, "device": "cuda", "world_size": world, "n_steps": 1024,
                "log_interval_steps": 512, "stop_at_return": None},
    )  # fmt: skip
    launcher = build_runner(config, tmp_path, show_progress=False)
    result = launcher.train()
    assert result.env_steps >= 1024
    digests = [outcome.digests for outcome in launcher.rank_outcomes]
    assert all(d is not None for d in digests) and len({d["final"] for d in digests if d}) == 1


@needs_cuda
def test_async_rl_learns_on_cuda_while_its_sampler_acts_on_the_cpu(tmp_path: Path) -> None:
    config = example(
        "pendulum_sac.toml",
        algo={"learning_starts": 100},
        runner={"kind": "async", "device": "cuda", "n_steps": 600, "log_interval_steps": 200},
    )
    runner = build_runner(config, tmp_path, show_progress=False)
    result = runner.train()
    assert result.env_steps >= 600 and model_device(runner.agent.model).type == "cuda"
    assert model_device(runner.algo.critic).type == "cuda"


@needs_cuda
def test_multilora_on_cuda_takes_the_grouped_path_and_agrees_with_the_loop_and_the_cpu() -> None:
    from rlplex.multirun import MultiLoRALinear

    torch.manual_seed(0)
    cpu = MultiLoRALinear(nn.Linear(64, 48), rank=16, n_adapters=4, alpha=16.0)
    with torch.no_grad():
        for adapter in (*cpu.lora_A, *cpu.lora_B):
            adapter.normal_(0, 0.2)
    gpu = copy.deepcopy(cpu).to("cuda", torch.bfloat16)
    x, ids = torch.randn(6, 40, 64), torch.randint(-1, 4, (6, 40))
    reference = cpu(x, ids)
    assert gpu._grouped_enabled(torch.empty(1, 64, device="cuda", dtype=torch.bfloat16))
    outputs, grads = [], []
    for grouped in (None, False):  # None: the automatic choice, grouped_mm on CUDA in bf16
        gpu.use_grouped_mm = grouped
        for p in gpu.parameters():
            p.grad = None
        y = gpu(x.to("cuda", torch.bfloat16), ids.cuda())
        y.float().square().mean().backward()
        outputs.append(y.float().cpu())
        grads.append([p.grad.float().cpu() for p in gpu.parameters() if p.grad is not None])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outputs[0], reference.detach(), rtol=5e-2, atol=5e-2)  # bf16 against float32
    assert len(grads[0]) == len(grads[1]) == 8
    for auto_grad, loop_grad in zip(*grads, strict=True):
        torch.testing.assert_close(auto_grad, loop_grad, rtol=2e-2, atol=2e-2 * float(loop_grad.abs().max()))
