"""A run's held-out evaluation (`OrchestratorConfig.evaluation`), done by its orchestrator.

The examples are drawn once, with the evaluation's own seed, from the held-out split of the run's
environment (`EvaluationConfig.env_spec`): the same problems at every evaluation and after any
restart. Policy steps 0 (the base model: a new adapter is zero), every `every`-th and the last
are evaluated, through the actor's engine with the adapter of that step, once per temperature.
Results go to `eval/progress.csv` in the run's folder (`RunDir.evaluations`) (and to the run's trackers), one row
per evaluated policy step: `eval/accuracy_t0` is the greedy accuracy, `eval/accuracy_t1` the
accuracy sampled at temperature 1, and `eval/reward_t*` the mean reward beside them. A restarted
orchestrator skips the steps that have a row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

from rlplex.diagnostics import MetricsLogger
from rlplex.errors import ConfigError, RunConfigError
from rlplex.models.hf import Tokenizer, encode_prompt
from rlplex.multirun.orchestrator.config import EvaluationConfig, OrchestratorConfig
from rlplex.multirun.orchestrator.models import ActorModel
from rlplex.multirun.rundir import RunDir
from rlplex.tasks import Environment, load_environment
from rlplex.tasks.evaluation import Evaluation, score_evaluation
from rlplex.tasks.reward_guard import reward_deadline

_BATCH = 64  # prompts per engine call: bounds the in-process engine's KV cache


def eval_key(kind: str, temperature: float) -> str:
    return f"eval/{kind}_t{temperature:g}"


def evaluation_env(config: OrchestratorConfig) -> Environment:
    assert config.evaluation is not None
    spec = config.evaluation.env_spec(config.env)
    try:
        return load_environment(spec)
    except ConfigError as error:
        raise RunConfigError(f"evaluation env: {error}") from None


class RunEvaluator:
    def __init__(
        self,
        run: RunDir,
        config: OrchestratorConfig,
        tokenizer: Tokenizer,
        tensorboard: bool,
        track: Callable[[int, Mapping[str, float]], None] | None = None,
    ) -> None:
        """`track`: where each evaluation row goes besides `eval/progress.csv` (the run's trackers)."""
        assert config.evaluation is not None
        self.settings: EvaluationConfig = config.evaluation
        self.max_steps = config.max_steps
        self.env = evaluation_env(config)
        rng = np.random.default_rng(self.settings.seed)
        self.examples = self.env.sample(self.settings.examples, rng)
        self.prompts = [encode_prompt(tokenizer, e) for e in self.examples]
        self.max_new_tokens = config.max_new_tokens or self.env.max_new_tokens
        self.reward_timeout_s = config.reward_timeout_s
        self.metrics = MetricsLogger(run.ensure_dir(run.evaluations.name), tensorboard, on_row=track)
        self.done = {int(row["step"]) for row in self.metrics.rows}

    def due(self, policy_step: int) -> bool:
        """Step 0, the first step in each new block of `every` (the orchestrator may see the
        policy advance by more than one step at a time), and the last step."""
        if policy_step in self.done:
            return False
        last = max(self.done, default=-1)
        return policy_step == self.max_steps or policy_step // self.settings.every > last // self.settings.every

    def evaluate(self, actor: ActorModel, policy_step: int) -> list[Evaluation]:
        started = time.perf_counter()
        results = []
        for temperature in self.settings.temperatures:
            completions: list[str] = []
            for start in range(0, len(self.prompts), _BATCH):
                chunk = self.prompts[start : start + _BATCH]
                seed = self.settings.seed + start
                completions += actor.complete(policy_step, chunk, temperature, seed, self.max_new_tokens)
            with reward_deadline(self.reward_timeout_s):
                results.append(score_evaluation(self.env, self.examples, completions, temperature))
        row = {eval_key(kind, e.temperature): getattr(e, kind) for e in results for kind in ("accuracy", "reward")}
        self.metrics.log(policy_step, {**row, "eval/seconds": time.perf_counter() - started})
        self.done.add(policy_step)
        return results

    def summary(self, results: list[Evaluation]) -> str:
        return ", ".join(f"accuracy {e.accuracy:.3f} at temperature {e.temperature:g}" for e in results)

    def close(self) -> None:
        self.metrics.close()


__all__ = ["RunEvaluator", "eval_key", "evaluation_env"]
