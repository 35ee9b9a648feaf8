"""Environments: toy tasks, arithmetic word problems, a user's JSONL/Parquet file, safe scoring, specs."""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from rlplex.errors import ConfigError
from rlplex.tasks import EnvSpec, Example, Rubric, environment_names, load_environment, safe_scores

# Drawn by the old `Task` classes with default_rng(0), n=4, before the toy generators moved: the new
# environments must keep every seed's meaning after the old classes are gone.
GOLDEN = {
    "reverse": [("r:fecca>", "accef"), ("r:abg>", "gba"), ("r:heeh>", "heeh"), ("r:feehc>", "cheef")],
    "sort_digits": [("s:65230>", "02356"), ("s:018>", "018"), ("s:9569>", "5699"), ("s:65592>", "25569")],
    "add": [("42+15=", "57"), ("31+2=", "33"), ("25+3=", "28"), ("13+0=", "13")],
}

REWARD_MODULE = "rlplex_test_user_rewards"


# --- toy environments ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_toy_envs_sample_as_before(name: str) -> None:
    env = load_environment(name)
    examples = env.sample(4, np.random.default_rng(0))
    assert [(e.prompt, e.answer) for e in examples] == GOLDEN[name]
    assert all(e.messages is None for e in examples)

    answers = [e.answer for e in env.sample(64, np.random.default_rng(1))]
    assert max(map(len, answers)) + 1 <= env.max_new_tokens  # room for the longest answer and EOS


def test_toy_reward_is_positional() -> None:
    env = load_environment({"name": "reverse"})
    examples = [Example(prompt="r:abcde>", answer="edcba")] * 4
    assert env.score(examples, ["edcba", "edcbx", "edc", "edcbaa"]) == pytest.approx([1.0, 0.8, 0.6, 5 / 6])


def test_toy_settings_are_validated() -> None:
    env = load_environment({"name": "reverse", "min_len": 2, "max_len": 2, "letters": "x"})
    assert [e.prompt for e in env.sample(2, np.random.default_rng(0))] == ["r:xx>", "r:xx>"]
    assert env.max_new_tokens == 3
    with pytest.raises(ConfigError, match="min_len"):
        load_environment({"name": "sort_digits", "min_len": 6, "max_len": 5})


# --- arithmetic ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "compute"),
    [("add", lambda a, b: a + b), ("subtract", lambda a, b: a - b), ("multiply", lambda a, b: a * b)],
)
def test_arithmetic_answers_are_correct(operation: str, compute: object) -> None:
    env = load_environment({"name": "arithmetic", "operations": [operation], "max_operand": 12})
    for example in env.sample(30, np.random.default_rng(1)):
        assert example.prompt is None and example.messages is not None
        assert [m["role"] for m in example.messages] == ["user"]
        a, b = (int(v) for v in re.findall(r"\d+", example.prompt_text))
        assert 2 <= min(a, b) and max(a, b) <= 12
        assert example.answer == str(compute(a, b))  # type: ignore[operator]
        assert int(example.answer) >= 0


def test_arithmetic_system_prompt_and_defaults() -> None:
    env = load_environment({"name": "arithmetic", "system_prompt": "Answer with a number."})
    assert env.max_new_tokens == 16
    (example,) = env.sample(1, np.random.default_rng(0))
    assert example.messages is not None
    assert [m["role"] for m in example.messages] == ["system", "user"]
    assert example.prompt_text == example.messages[1]["content"]


def test_arithmetic_keeps_its_problems_for_a_seed() -> None:
    # A setting that did not exist must not change what a seed draws (benchmarks quote seeds).
    (first,) = load_environment("arithmetic").sample(1, np.random.default_rng(0))
    assert first.prompt_text == "A box holds 11 apples. Li takes out 7. How many apples are left in the box?"


def test_arithmetic_steps_grade_the_problems_and_chain_operations() -> None:
    env = load_environment({"name": "arithmetic", "steps": [2, 3], "operations": ["add", "subtract", "multiply"]})
    for example in env.sample(60, np.random.default_rng(2)):
        text = example.prompt_text
        numbers = [int(v) for v in re.findall(r"\d+", text)]
        count = numbers[0]
        for action, b in zip(re.findall(r"(buys|gives|times)", text), numbers[1:], strict=True):
            count = count + b if action == "buys" else count - b if action == "gives" else count * b
            assert count > 0
        assert example.answer == str(count) and len(numbers) - 1 in (2, 3)


def test_arithmetic_heldout_split_is_disjoint_seeded_and_by_problem() -> None:
    def keys(split: str, seed: int) -> set[str]:
        spec = {"name": "arithmetic", "max_operand": 9, "heldout_fraction": 0.2, "split": split}
        return {re.sub(r"[A-Z][a-z]+ |apples|pencils|marbles|books|cookies|stickers", "", e.prompt_text)
                for e in load_environment(spec).sample(400, np.random.default_rng(seed))}  # fmt: skip

    train, heldout = keys("train", 0), keys("heldout", 1)
    assert heldout and train and not (train & heldout)  # no held-out problem, in any wording, is trained on
    assert keys("heldout", 1) == heldout and keys("train", 3) & train
    with pytest.raises(ConfigError, match="needs a heldout_fraction above 0"):
        load_environment({"name": "arithmetic", "split": "heldout"})
    with pytest.raises(ConfigError, match=r"steps must each be 1, 2 or 3"):
        load_environment({"name": "arithmetic", "steps": [4]})


def test_arithmetic_answer_format_and_its_reward() -> None:
    env = load_environment({"name": "arithmetic", "answer_format": True, "format_weight": 0.25})
    (example,) = env.sample(1, np.random.default_rng(0))
    assert example.prompt_text.endswith("Give the final answer as a number after 'Answer:'.")
    replies = ["11 - 7 = 4. Answer: 4", "Answer: 4.", "It is 4 apples.", "Answer: 5", "4 Answer: 3 is wrong"]
    assert env.correct([example] * 5, replies) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert env.score([example] * 5, replies) == [1.25, 1.25, 1.0, 0.25, 0.0]


ARITHMETIC_CASES = [("8", 1.0), ("The answer is 8.", 1.0), ("\\boxed{8}", 1.0), ("9", 0.0), ("", 0.0)]


def _score_eight(completions: list[str]) -> list[float]:
    env = load_environment("arithmetic")
    example = Example(messages=({"role": "user", "content": "Tom has 3 apples and buys 5 more..."},), answer="8")
    return env.score([example] * len(completions), completions)


def test_arithmetic_scores_with_math_verify() -> None:
    assert _score_eight([c for c, _ in ARITHMETIC_CASES]) == [r for _, r in ARITHMETIC_CASES]


def test_arithmetic_scores_outside_the_main_thread() -> None:
    # math-verify's default SIGALRM timeouts fail in a thread; a failure would show as 0.0 scores here.
    with ThreadPoolExecutor(max_workers=1) as pool:
        scores = pool.submit(_score_eight, [c for c, _ in ARITHMETIC_CASES]).result(timeout=60)
    assert scores == [r for _, r in ARITHMETIC_CASES]
    box: list[list[float]] = []
    thread = threading.Thread(target=lambda: box.append(_score_eight(["8", "9"])))
    thread.start()
    thread.join(timeout=60)
    assert box == [[1.0, 0.0]]


# --- a user's file -----------------------------------------------------------------------------


@pytest.fixture
def user_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user's reward module on sys.path; yields its name."""
    folder = tmp_path / "user_code"
    folder.mkdir()
    (folder / f"{REWARD_MODULE}.py").write_text(
        "def contains(prompt, completion, answer):\n"
        "    return 1.0 if answer in completion else 0.0\n"
        "\n"
        "def prompt_length(prompt, completion, answer):\n"
        "    return float(len(prompt))\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    yield REWARD_MODULE
    sys.modules.pop(REWARD_MODULE, None)


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeps `datasets`' Arrow cache of the test files out of the home directory."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


PROMPT_ROWS: list[dict[str, object]] = [
    {"prompt": "2+2=", "answer": "4"},
    {"prompt": "3+3=", "answer": 6},  # an int answer is read as its text
    {"prompt": "4+4=", "answer": "8", "note": "extra columns are ignored"},
]


@pytest.mark.usefixtures("hf_cache")
def test_jsonl_prompts_and_dotted_reward(tmp_path: Path, user_rewards: str) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", PROMPT_ROWS)
    env = load_environment({"name": "jsonl", "path": str(path), "reward": f"{user_rewards}:contains"})
    assert env.name == "jsonl" and env.max_new_tokens == 64
    rng = np.random.default_rng(0)
    epoch = env.sample(3, rng)
    assert sorted((e.prompt, e.answer) for e in epoch) == [("2+2=", "4"), ("3+3=", "6"), ("4+4=", "8")]
    assert len(env.sample(5, rng)) == 5  # crosses into the next epoch
    assert env.score(epoch, [f"it is {e.answer}" for e in epoch[:2]] + ["no idea"]) == [1.0, 1.0, 0.0]

    again = load_environment({"name": "jsonl", "path": str(path), "reward": f"{user_rewards}.contains"})
    assert again.sample(3, np.random.default_rng(0)) == epoch  # deterministic for a given rng


@pytest.mark.usefixtures("hf_cache")
def test_jsonl_relative_path_and_no_shuffle(tmp_path: Path, user_rewards: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_jsonl(tmp_path / "data.jsonl", PROMPT_ROWS)
    monkeypatch.chdir(tmp_path)
    spec = {"name": "jsonl", "path": "data.jsonl", "reward": f"{user_rewards}:contains", "shuffle": False}
    env = load_environment(spec)
    assert [e.prompt for e in env.sample(4, np.random.default_rng(0))] == ["2+2=", "3+3=", "4+4=", "2+2="]


@pytest.mark.usefixtures("hf_cache")
def test_jsonl_messages(tmp_path: Path, user_rewards: str) -> None:
    rows: list[dict[str, object]] = [
        {"chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}], "gold": "2"},
        {"chat": [{"role": "user", "content": "2+3?"}], "gold": "5"},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    spec = {
        "name": "jsonl",
        "path": str(path),
        "messages_field": "chat",
        "answer_field": "gold",
        "reward": f"{user_rewards}:prompt_length",
        "max_new_tokens": 8,
    }
    env = load_environment(spec)
    examples = sorted(env.sample(2, np.random.default_rng(0)), key=lambda e: e.answer)
    assert [e.messages for e in examples] == [tuple(row["chat"]) for row in rows]  # type: ignore[arg-type]
    assert [e.prompt_text for e in examples] == ["1+1?", "2+3?"]
    assert env.max_new_tokens == 8
    assert env.score(examples, ["", ""]) == [4.0, 4.0]  # the reward sees the last user message


@pytest.mark.usefixtures("hf_cache")
def test_parquet(tmp_path: Path, user_rewards: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "2+2=", "answer": "4"}]), tmp_path / "data.parquet")
    env = load_environment(
        {"name": "parquet", "path": str(tmp_path / "data.parquet"), "reward": f"{user_rewards}:contains"}
    )
    (example,) = env.sample(1, np.random.default_rng(0))
    assert (example.prompt, example.answer) == ("2+2=", "4")
    assert env.score([example], ["4"]) == [1.0]

    # Arrow gives every message the union of all messages' keys, the missing ones as None; they are dropped.
    chats = [
        {
            "messages": [{"role": "system", "content": "Hi", "name": "x"}, {"role": "user", "content": "a"}],
            "answer": "1",
        },
        {"messages": [{"role": "user", "content": "b"}], "answer": "2"},
    ]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chat.parquet")
    spec = {
        "path": str(tmp_path / "chat.parquet"),
        "messages_field": "messages",
        "reward": "rlplex.tasks.rewards:exact_match",
    }
    env = load_environment({"name": "parquet", **spec, "shuffle": False})
    first, second = env.sample(2, np.random.default_rng(0))
    assert first.messages == tuple(chats[0]["messages"])
    assert second.messages == ({"role": "user", "content": "b"},)
    assert env.score([first, second], [" 1 ", "3"]) == [1.0, 0.0]


@pytest.mark.usefixtures("hf_cache")
def test_bad_rows_name_file_row_and_field(tmp_path: Path, user_rewards: str) -> None:
    reward = f"{user_rewards}:contains"
    path = _write_jsonl(tmp_path / "bad.jsonl", [*PROMPT_ROWS[:2], {"prompt": "5+5="}])
    with pytest.raises(ConfigError, match=r"bad\.jsonl: row 2: field 'answer' is missing"):
        load_environment({"name": "jsonl", "path": str(path), "reward": reward})

    path = _write_jsonl(tmp_path / "float.jsonl", [{"prompt": "1/2=", "answer": 0.5}])
    with pytest.raises(ConfigError, match=r"float\.jsonl: row 0: field 'answer' must be a string"):
        load_environment({"name": "jsonl", "path": str(path), "reward": reward})

    path = _write_jsonl(tmp_path / "noprompt.jsonl", [{"question": "x", "answer": "1"}])
    with pytest.raises(ConfigError, match=r"noprompt\.jsonl: row 0: field 'prompt' is missing"):
        load_environment({"name": "jsonl", "path": str(path), "reward": reward})

    rows: list[dict[str, object]] = [
        {"messages": [{"role": "user", "content": "a"}], "answer": "1"},
        {"messages": [{"role": "robot", "content": "a"}], "answer": "1"},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ConfigError, match=r"chat\.jsonl: row 1: field 'messages': message 0: unknown role 'robot'"):
        load_environment({"name": "jsonl", "path": str(path), "reward": reward, "messages_field": "messages"})


@pytest.mark.usefixtures("hf_cache")
def test_bad_files_are_named(tmp_path: Path, user_rewards: str) -> None:
    reward = f"{user_rewards}:contains"
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.parquet").write_text("not parquet")
    for path, problem in [
        (tmp_path / "absent.jsonl", "not found"),
        (tmp_path, "not a regular file"),
        (tmp_path / "empty.jsonl", "is empty"),
    ]:
        with pytest.raises(ConfigError, match=f"{re.escape(str(path))}: .*{problem}"):
            load_environment({"name": "jsonl", "path": str(path), "reward": reward})
    with pytest.raises(ConfigError, match=r"broken\.parquet: cannot read as parquet"):
        load_environment({"name": "parquet", "path": str(tmp_path / "broken.parquet"), "reward": reward})


@pytest.mark.parametrize(
    ("reward", "problem"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("rlplex.tasks.rewards:no_such_function", "has no attribute 'no_such_function'"),
        ("rlplex.tasks.environment:ROLES", "is not callable"),
        ("nodots", "is not a dotted path"),
    ],
)
def test_bad_reward_path_names_setting_and_value(tmp_path: Path, reward: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_environment({"name": "jsonl", "path": str(tmp_path / "x.jsonl"), "reward": reward})
    assert "'reward'" in str(caught.value) and reward in str(caught.value) and problem in str(caught.value)


# --- safe scoring, rubrics, examples -------------------------------------------------------------


def _flaky(prompt: str, completion: str, answer: str) -> float:
    if completion == "boom":
        raise ValueError("cannot parse boom")
    if completion == "nan":
        return float("nan")
    if completion == "text":
        return "1.0"  # type: ignore[return-value]
    return 1.0 if completion == answer else 0.5


def test_safe_scores_zeroes_failures_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    examples = [Example(prompt=f"p{i}", answer="a") for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="rlplex.tasks"):
        scores = safe_scores(_flaky, examples, ["a", "boom", "b", "nan", "text"], env_name="my_env")
    assert scores == [1.0, 0.0, 0.5, 0.0, 0.0]
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    for part in ["'my_env'", "3 of 5", "row 1", "cannot parse boom", "row 3", "nan", "row 4", "'1.0'"]:
        assert part in message

    caplog.clear()
    assert safe_scores(_flaky, examples[:2], ["a", "x"], env_name="my_env") == [1.0, 0.5]
    assert not caplog.records
    with pytest.raises(Exception, match="2 examples but 1 completions"):
        safe_scores(_flaky, examples[:2], ["a"], env_name="my_env")


def test_rubric_weights_functions() -> None:
    rubric = Rubric([(lambda p, c, a: 1.0 if c == a else 0.0, 0.75), (lambda p, c, a: float(len(c) <= 3), 0.25)])
    assert rubric("q", "abc", "abc") == 1.0
    assert rubric("q", "abcd", "abc") == 0.0
    assert rubric("q", "ab", "abc") == 0.25
    with pytest.raises(ConfigError, match="weight 0"):
        Rubric([(lambda p, c, a: 0.0, float("inf"))])
    with pytest.raises(ConfigError, match="at least one"):
        Rubric([])


def test_example_needs_exactly_one_prompt_form() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        Example(answer="1")
    with pytest.raises(ConfigError, match="exactly one"):
        Example(answer="1", prompt="p", messages=({"role": "user", "content": "p"},))
    with pytest.raises(ConfigError, match="no 'user' message"):
        Example(answer="1", messages=({"role": "system", "content": "s"},))
    chat = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "last"},
    ]
    example = Example(answer="1", messages=chat)  # type: ignore[arg-type]
    chat[2]["content"] = "changed"
    assert example.prompt_text == "last" and isinstance(example.messages, tuple)


# --- specs ------------------------------------------------------------------------------------


def test_env_spec_and_names() -> None:
    assert {"reverse", "sort_digits", "add", "arithmetic", "jsonl", "parquet"} <= set(environment_names())
    spec = EnvSpec.model_validate({"name": "add", "max_operand": 5})
    assert spec.name == "add" and spec.model_extra == {"max_operand": 5}
    env = load_environment(spec)
    assert env.max_new_tokens == 3
    assert all(int(e.answer) <= 10 for e in env.sample(50, np.random.default_rng(0)))

    with pytest.raises(ConfigError, match=r"unknown environment 'revers'.*arithmetic.*reverse"):
        load_environment({"name": "revers"})
    with pytest.raises(ConfigError, match=r"env 'reverse': field 'max_lenn'.*[Ee]xtra"):
        load_environment({"name": "reverse", "max_lenn": 4})
    with pytest.raises(ConfigError, match=r"(?s)env 'arithmetic'.*field 'operations\.0'.*'divide'"):
        load_environment({"name": "arithmetic", "operations": ["divide"]})
    with pytest.raises(ConfigError, match="field 'name'"):
        load_environment({"max_len": 4})


@pytest.mark.usefixtures("hf_cache")
def test_check_environment_calls_the_reward_once_on_a_row_before_any_run_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, hole 2: a reward that cannot score even a row's own answer fails the check,
    naming the setting and what went wrong; one that scores passes."""
    from rlplex.tasks.registry import check_environment

    (tmp_path / "checked_rewards.py").write_text(
        "def good(prompt, completion, answer):\n    return float(completion == answer)\n"
        "def raises(prompt, completion, answer):\n    return int(completion) / 0\n"
        "def text(prompt, completion, answer):\n    return 'yes'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write_jsonl(tmp_path / "data.jsonl", PROMPT_ROWS)

    def env(reward: str) -> dict[str, str]:
        return {"name": "jsonl", "path": str(path), "reward": f"checked_rewards:{reward}"}

    check_environment(env("good"))
    check_environment("reverse")  # rlplex's own: built is checked
    with pytest.raises(ConfigError, match=r"field 'reward': 'checked_rewards:raises' raised ZeroDivisionError"):
        check_environment(env("raises"))
    with pytest.raises(ConfigError, match=r"'checked_rewards:text' returned 'yes' on a row of its data"):
        check_environment(env("text"))
    with pytest.raises(ConfigError, match=r"checked_rewards:missing"):
        check_environment(env("missing"))
    sys.modules.pop("checked_rewards", None)
