"""README.md reads in the order a newcomer needs it: what rlplex is and for whom, the two make
commands on the first screen, the quickstart, many runs on one trainer, then the reference; and
it speaks the user's language, not the project's (no issue or seed numbers)."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_first_screen_says_what_rlplex_is_and_for_whom_then_the_two_commands() -> None:
    first_screen = "\n".join(README.splitlines()[:50])
    for words in ("Coming from TRL", "Stable-Baselines3", "prime-rl", "make demo", "make test"):
        assert words in first_screen, words


def test_sections_come_quickstart_first_then_many_runs_then_the_reference() -> None:
    headings = re.findall(r"(?m)^## (.+)$", README)
    order = [
        "Quickstart: your model, your data, your reward",
        "Many LLM runs on one trainer",
        "Classic RL with the runners",
        "Control-plane jobs",
        "Benchmarks",
        "Tests",
        "Layout",
    ]
    assert [h for h in headings if h in order] == order, headings


def test_no_internal_issue_or_seed_numbers_in_user_text() -> None:
    found = re.findall(r"\bissues? \d+\b|\bseed \d{3}\b|\(00\d(?:, 00\d)*\)", README)
    assert not found, found


def test_the_words_of_the_seed_systems_are_explained_where_they_first_appear() -> None:
    # (term, what its first mention must carry within the same paragraph)
    for term, explained in (("PrimeMaster", "places"), ("MFC", "one\ncall of a model"), ("STABLE", "complete")):
        prose = re.sub(r"(?ms)^```.*?^```", "", README)  # a diagram names them without explaining
        paragraph = next(p for p in prose.split("\n\n") if term in p)
        assert explained in paragraph, (term, paragraph[:300])
