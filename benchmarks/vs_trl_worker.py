"""The processes `benchmarks.vs_trl` starts (a JSON file on the command line, no pickle):

    python -m benchmarks.vs_trl_worker trl RUN.json    one TRL GRPOTrainer run (a `vs_trl.TrlJob`)
    python -m benchmarks.vs_trl_worker model NAME      build tiny or smollm2 once; print the folder

`trl` trains a peft LoRA of the run's model with `trl.GRPOTrainer` and writes, in the job's
output folder, `adapter/` (the final adapter, peft's layout) and `result.json` (the reward and
generated tokens of every generation, one per step). The reward is rlplex's: the run's
environment scores the completions, on the problems an rlplex run with the same seed draws.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.vs_trl_runs import (
    INSTALL_HINT,
    TINY_TASK,
    TINY_WARMUP_STEPS,
    RunSettings,
    TrlJob,
    lora_arguments,
    trl_arguments,
)
from rlplex.tasks import Environment, Example, load_environment


def step_examples(env: Environment, run: RunSettings) -> list[Example]:
    """The problems of every step, in order, as an rlplex run draws them (the orchestrator's
    `StepPrompts.prepare`: a generator seeded with [seed, step, attempt], attempt 0)."""
    return [e for step in range(run.steps) for e in env.sample(run.prompts, np.random.default_rng([run.seed, step, 0]))]


def reward_function(env: Environment, log: list[dict[str, float]]) -> Callable[..., list[float | None]]:
    """TRL's reward function: the environment's `score()` (format terms included, as rlplex
    trains on it); each call is one step's generation, logged."""

    def rlplex_reward(
        prompts: list[list[dict[str, str]]],
        completions: list[list[dict[str, str]]],
        completion_ids: list[list[int]],
        answer: list[str],
        **_: Any,
    ) -> list[float | None]:
        examples = [Example(answer=a, messages=tuple(p)) for p, a in zip(prompts, answer, strict=True)]
        scores = env.score(examples, [c[-1]["content"] for c in completions])
        tokens = sum(len(ids) for ids in completion_ids)  # up to and including EOS, as rlplex counts them
        log.append({"reward": sum(scores) / len(scores), "generated_tokens": tokens, "time": time.time()})
        return list(scores)

    return rlplex_reward


def check_prompts(tokenizer: Any, examples: list[Example]) -> None:
    """TRL renders a conversational prompt with the tokenizer's chat template (generation prompt
    on); the run must get the token ids rlplex's `encode_prompt` gives."""
    from rlplex.models.hf import encode_prompt

    for example in examples:
        rendered = tokenizer.apply_chat_template(
            [list(example.messages or ())], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        if list(rendered["input_ids"][0]) != encode_prompt(tokenizer, example):
            raise SystemExit(f"TRL would render the prompt {example.messages} unlike rlplex")


def train_trl(job: TrlJob) -> None:
    import torch

    torch.set_num_threads(job.threads)
    try:
        import peft
        import trl
        from datasets import Dataset
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None
    from torch.optim.lr_scheduler import LambdaLR

    from rlplex.models.hf import load_causal_lm, load_tokenizer
    from rlplex.models.spec import ModelSpec
    from rlplex.multirun.trainer.lora_apply import default_target_modules
    from rlplex.multirun.trainer.run_optim import linear_decay

    run, out = job.run, Path(job.output_dir)
    env = load_environment(run.env)
    examples = step_examples(env, run)
    rows = [{"prompt": [dict(m) for m in e.messages or ()], "answer": e.answer} for e in examples]
    spec = ModelSpec(name=run.model)
    tokenizer = load_tokenizer(spec)
    check_prompts(tokenizer, examples[: run.prompts])
    model = load_causal_lm(spec, torch.device("cpu"))
    lora = peft.LoraConfig(**lora_arguments(run), target_modules=list(default_target_modules(model)))
    model = peft.get_peft_model(model, lora)
    # rlplex's optimizer for a run: fused AdamW over the adapter, linear decay to 0.1x over its steps.
    params = [p for p in model.parameters() if p.requires_grad]
    arguments = trl_arguments(job)
    optimizer = torch.optim.AdamW(
        params, lr=arguments["learning_rate"], weight_decay=arguments["weight_decay"], fused=True
    )
    scheduler = LambdaLR(optimizer, linear_decay(run.steps))
    log: list[dict[str, float]] = []
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_function(env, log),
        args=trl.GRPOConfig(**arguments),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        optimizers=(optimizer, scheduler),
    )
    trainer.train()
    adapter = out / "adapter"
    model.save_pretrained(str(adapter))  # the trainer trained this very PeftModel
    result = {
        "rewards": [entry["reward"] for entry in log],
        "generated_tokens": [entry["generated_tokens"] for entry in log],
        "times": [entry["time"] for entry in log],
        "adapter": str(adapter),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))


def model_folder(name: str) -> Path:
    from benchmarks.common import smollm2_checkpoint, tiny_checkpoint

    if name == "tiny":
        return tiny_checkpoint(tasks=(TINY_TASK,), warmup_steps=TINY_WARMUP_STEPS)
    if name == "smollm2":
        return smollm2_checkpoint()
    if not Path(name).is_dir():
        raise SystemExit(f"--model {name!r}: not tiny, smollm2 or a model folder")
    return Path(name).resolve()


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("trl", "model"):
        raise SystemExit(__doc__)
    if argv[0] == "model":
        print(model_folder(argv[1]))
        return
    train_trl(TrlJob.model_validate_json(Path(argv[1]).read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
