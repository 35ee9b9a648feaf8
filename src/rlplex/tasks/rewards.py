"""Built-in reward functions, and finding a user's reward function by its dotted path.

Every reward is a `RewardFn`: `(prompt_text, completion, answer) -> float`. A config names one as
"package.module:function" (or "package.module.function"), e.g. "rlplex.tasks.rewards:math_answer".
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import cast

from rlplex.errors import ConfigError
from rlplex.tasks.environment import RewardFn


def exact_match(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion is the answer, surrounding whitespace aside."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def positional_match(prompt: str, completion: str, answer: str) -> float:
    """The fraction of answer positions right; a length mismatch counts as wrong positions.

    A partly right answer still carries a learning signal for a model that starts from nothing.
    """
    width = max(len(answer), len(completion))
    if width == 0:
        return 1.0
    right = sum(1 for a, c in zip(answer, completion, strict=False) if a == c)
    return right / width


def _warm_up_math_verify() -> None:
    """Import math-verify and build its parsers (a second and more on a busy machine): the reward
    guard runs this when its worker loads `math_answer`, so no row's deadline pays for it."""
    from math_verify import parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    parse("$1$", parsing_timeout=None)


def math_answer(prompt: str, completion: str, answer: str) -> float:
    """1.0 when math-verify judges the completion's final answer equal to the reference, else 0.0."""
    # Imported here: sympy behind it costs half a second, which runs without math rewards should not pay.
    from math_verify import parse, verify

    # math-verify's own timeouts use SIGALRM, which only works in a main thread, and cannot stop a C
    # call that holds the GIL (`9^{9^{9}}`): they are off. The bound is the reward guard's deadline
    # (`rlplex.tasks.reward_guard`: the call runs in a child process, killed when late). Its warning
    # that they are off would land in every orchestrator's log: it is said here instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(answer, parsing_timeout=None) or parse(f"${answer}$", parsing_timeout=None)
    if not gold:
        # Else every completion would score 0 and the run would learn nothing without saying why.
        raise ConfigError(f"math_verify cannot read the reference answer {answer!r:.80}")
    predicted = parse(completion, parsing_timeout=None)
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


math_answer.warm_up = _warm_up_math_verify  # type: ignore[attr-defined]


def import_reward(path: str, field: str = "reward") -> RewardFn:
    """The callable that `path` ("package.module:function" or "package.module.function") names.

    Raises `ConfigError` naming `field` and `path` when the module or the attribute is missing or is
    not callable; an error raised while importing the user's module is reported the same way.
    """
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ConfigError(f"field {field!r}: {path!r} is not a dotted path like 'package.module:function'")
    try:
        target: object = importlib.import_module(module_name)
    except Exception as error:  # a user's module can fail in any way while it runs its top level
        where = ""
        if isinstance(error, ModuleNotFoundError) and error.name == module_name.split(".")[0]:
            where = f" (modules are found in the directory rlplex runs in, {os.getcwd()}, and on PYTHONPATH)"
        raise ConfigError(
            f"field {field!r}: cannot import module {module_name!r} for {path!r}: {error!r}{where}"
        ) from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(f"field {field!r}: {path!r}: {module_name!r} has no attribute {attribute!r}") from None
    if not callable(target):
        raise ConfigError(f"field {field!r}: {path!r} is not callable (got {target!r:.80})")
    # Its signature is the user's promise; a mismatch shows when it runs, as a scored-0 failure.
    return cast(RewardFn, target)
