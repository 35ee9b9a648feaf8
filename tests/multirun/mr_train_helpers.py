"""Helpers for the trainer tests: synthetic rollouts that do not depend on the policy, and trainers."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from lm_models import untrained_tiny_model
from rlplex.models.device import model_device
from rlplex.models.hf import Tokenizer, load_causal_lm, load_tokenizer
from rlplex.models.lm import token_logprobs
from rlplex.models.spec import ModelSpec
from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.rollouts import RolloutBatch, write_rollouts
from rlplex.multirun.trainer.config import TrainerConfig
from rlplex.multirun.trainer.loop import MultiRunTrainer
from timing import scaled

_BASE: dict[int, torch.nn.Module] = {}


def shared_model() -> ModelSpec:
    """The runs and trainers of these tests share the untrained tiny checkpoint (no warm-up).

    In float32 on every device: on a GPU `auto` is bfloat16, whose rounding alone moves a run's
    weights by 1e-2 when it shares micro-batches (measured on an H200 and in bfloat16 on the
    CPU), which would hide the leaks the equality tests look for."""
    return ModelSpec(name=str(untrained_tiny_model()), dtype="float32")


def new_train_run(output_dir: Path, name: str, **overrides: object) -> RunDir:
    """`mr_helpers.new_run` (which names the tests' model)."""
    from mr_helpers import new_run

    return new_run(output_dir, name, **overrides)


def base_model() -> torch.nn.Module:
    if 0 not in _BASE:
        _BASE[0] = load_causal_lm(shared_model())
    return _BASE[0]


def tokenizer() -> Tokenizer:
    return load_tokenizer(shared_model())


def synthetic_batch(run_id: str, step: int, n: int = 6, width: int = 10, seed: int = 0) -> RolloutBatch:
    """Rows of random prompts and completions with the base policy's log-probs, jittered so that
    some ratios fall outside the clip range; a function of (seed, step) only."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    vocab = len(tokenizer())
    tokens = torch.randint(3, vocab, (n, width), generator=gen)
    attention = torch.ones(n, width, dtype=torch.int64)
    loss_mask = torch.zeros(n, width, dtype=torch.bool)
    for i in range(n):
        pad = int(torch.randint(0, 3, (1,), generator=gen))
        completion = int(torch.randint(1, width // 2, (1,), generator=gen))
        tail = int(torch.randint(0, 2, (1,), generator=gen))
        attention[i, :pad] = 0
        tokens[i, :pad] = 0
        if tail:
            attention[i, width - tail :] = 0
            tokens[i, width - tail :] = 0
        end = width - tail
        loss_mask[i, end - completion : end] = True
    with torch.no_grad():
        device = model_device(base_model())  # the GPU where there is one: the trainers train there
        base = token_logprobs(base_model(), tokens.to(device), attention.to(device)).cpu()
    noise = 0.3 * torch.randn(n, width, generator=gen)
    logprobs = torch.where(loss_mask, (base + noise).clamp(max=0.0), torch.zeros(n, width))
    return RolloutBatch(
        run_id=run_id,
        step=step,
        policy_step=step,
        tokens=tokens,
        attention=attention,
        loss_mask=loss_mask,
        logprobs=logprobs.float(),
        advantages=torch.randn(n, generator=gen),
        rewards=torch.rand(n, generator=gen),
    )


def write_synthetic(output_dir: Path, run_id: str, steps: range, **kwargs: object) -> None:
    run = RunDir(output_dir, run_id)
    for step in steps:
        write_rollouts(run, synthetic_batch(run_id, step, **kwargs))  # type: ignore[arg-type]


def make_trainer(output_dir: Path, max_runs: int, **overrides: object) -> MultiRunTrainer:
    config = TrainerConfig.model_validate(
        {"output_dir": output_dir, "max_runs": max_runs, "model": shared_model(), **overrides}
    )
    import copy

    return MultiRunTrainer(config, base_model=copy.deepcopy(base_model()))


def train_until(trainer: MultiRunTrainer, done: dict[str, int], max_iterations: int = 200) -> None:
    """Iterate until every run in `done` has reached its step (fails loudly otherwise)."""
    for _ in range(max_iterations):
        steps = {rid: trainer.manager.progress[idx].step for rid, idx in trainer.manager.id_2_idx.items()}
        if all(steps.get(rid, -1) >= step for rid, step in done.items()):
            trainer.flush()
            return
        trainer.iteration()
    raise AssertionError(f"runs did not reach {done}: {steps}")


def iterate_until(trainer: MultiRunTrainer, condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """Trainer iterations, polling like `MultiRunTrainer.run`, until `condition` holds (the writer
    thread writes the finished marker between iterations)."""
    deadline = time.monotonic() + scaled(timeout_s)
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        trainer.iteration()
        time.sleep(0.01)


def broadcast_weights(output_dir: Path, run_id: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(RunDir(output_dir, run_id).broadcast_step(step) / "adapter_model.safetensors"))


class FakeOrchestrator:
    """The smallest orchestrator: loads `broadcast/step_K`, samples from the tiny LM, rewards the
    letter 'a', writes `rollouts/step_K` with write_rollouts. Not the real one (another module)."""

    TARGET = "a"

    def __init__(self, run: RunDir, rank: int, alpha: float, batch_size: int = 32, seed: int = 0) -> None:
        import copy

        from rlplex.multirun.trainer.lora_apply import apply_multi_lora

        self.run, self.batch_size = run, batch_size
        self.tokenizer = tokenizer()
        self.model = copy.deepcopy(base_model())
        self.lora = apply_multi_lora(
            self.model,
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            rank=rank,
            n_adapters=1,
            alpha=alpha,
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.prompts = [f"r:{w}>" for w in ("abc", "hgf", "dead", "bead", "cafe", "fed", "gag", "ebb")]

    def load(self, step: int) -> None:
        weights = broadcast_weights(self.run.output_dir, self.run.run_id, step)
        for name, module in self.lora.modules.items():
            key = f"base_model.model.{name}"
            module.load_adapter_state_dict(
                0, {"lora_A.weight": weights[f"{key}.lora_A.weight"], "lora_B.weight": weights[f"{key}.lora_B.weight"]}
            )

    def target_nll(self) -> float:
        """Mean -log p('a') at the first completion position: what the reward pushes down."""
        from rlplex.models.lm import left_pad

        tokens, attention = left_pad([self.tokenizer.encode(p) for p in self.prompts], self.tokenizer.pad_token_id)
        target = self.tokenizer.convert_tokens_to_ids(self.TARGET)
        with torch.no_grad(), self.lora.active_adapters(torch.zeros(len(self.prompts), dtype=torch.long)):
            logits = self.model(input_ids=tokens, attention_mask=attention).logits[:, -1].float()
        return float(-torch.log_softmax(logits, -1)[:, target].mean())

    def rollouts(self, step: int) -> RolloutBatch:
        from rlplex.models.lm import generate

        prompts = [self.tokenizer.encode(self.prompts[i % len(self.prompts)]) for i in range(self.batch_size)]
        with self.lora.active_adapters(torch.zeros(self.batch_size, dtype=torch.long)):
            out = generate(self.model, self.tokenizer, prompts, 4, 1.0, self.generator)
        rewards = torch.tensor([c.count(self.TARGET) / 4 for c in out.completions], dtype=torch.float32)
        return RolloutBatch(
            run_id=self.run.run_id,
            step=step,
            policy_step=step,
            tokens=out.tokens_B_L,
            attention=out.attention_B_L,
            loss_mask=out.completion_mask_B_L,
            logprobs=out.logprobs_B_L.float(),
            advantages=rewards - rewards.mean(),
            rewards=rewards,
        )

    def write(self, step: int) -> None:
        write_rollouts(self.run, self.rollouts(step))


# Three runs that differ in everything a run can set: rank, alpha, lr, clipping, weight decay,
# schedule length, samples per step and sample length.
RUNS: dict[str, tuple[dict[str, object], dict[str, int]]] = {
    "run_a": ({"model": {"lora": {"rank": 4, "alpha": 8.0}}, "optim": {"lr": 0.01}, "max_steps": 4}, {"seed": 1}),
    "run_b": (
        {"optim": {"lr": 0.003, "max_grad_norm": 0.05, "weight_decay": 0.1}},
        {"seed": 2, "n": 9, "width": 14},
    ),
    "run_c": ({"model": {"lora": {"rank": 2, "alpha": 1.0}}, "optim": {"lr": 0.02}}, {"seed": 3, "n": 3, "width": 8}),
}
STEPS = 3
PACKED = {"micro_tokens": 40, "micro_batches": 2}
"""Small micro-batches: steps span several micro-batches and iterations, runs share micro-batches."""


def make_runs(output_dir: Path, names: list[str], steps: int = STEPS, as_name: dict[str, str] | None = None) -> None:
    """Create runs from RUNS (optionally under another name) with rollouts for steps [0, steps)."""
    for name in names:
        run_id = (as_name or {}).get(name, name)
        config, data = RUNS[name]
        new_train_run(output_dir, run_id, **config)
        write_synthetic(output_dir, run_id, range(steps), **data)


def train_alone(output_dir: Path, name: str, steps: int = STEPS, run_id: str | None = None) -> dict[str, torch.Tensor]:
    run_id = run_id or name
    make_runs(output_dir, [name], steps, {name: run_id})
    trainer = make_trainer(output_dir, 1)
    train_until(trainer, {run_id: steps})
    return broadcast_weights(output_dir, run_id, steps)


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-4) -> None:
    """Equal up to float32 summation order: the same run alone, packed into other micro-batches,
    differs by up to 3.6e-5 (Adam at lr 0.01 magnifies rounding on near-zero gradients); a run that
    leaked another's gradient or state differs by orders of magnitude more."""
    assert sorted(got) == sorted(want)
    worst = max(float((got[k].cpu() - want[k].cpu()).abs().max()) for k in want)
    assert worst <= atol, f"max abs difference {worst:.3g} > {atol}"
