"""The reward of `examples/my_data/job.toml`: your own reward is a function like this one.

rlplex calls it as `reward(prompt, completion, answer) -> float` for every sampled completion,
in a child process under a deadline (`reward_timeout_s`), so it must be defined at module level.
The job file names it as `module:function`; the module is imported from the directory you run
`rlplex` in (and PYTHONPATH), here the repository's root.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def exact_number(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the reply's last number is the answer; partial credit for a number close to it
    (0.5 at a distance of 1, falling off), so that replies a little wrong still tell apart
    from replies with no number at all, which score 0."""
    numbers = _NUMBER.findall(completion)
    if not numbers:
        return 0.0
    distance = abs(int(numbers[-1]) - int(answer))
    return 1.0 if distance == 0 else 0.5 / distance
