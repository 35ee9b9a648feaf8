"""A `JobView` as the page's JSON: the job line, one row per run, the nodes, the event log, and
the learning curves sent incrementally.

A page that already holds the first `n` points of a run's curve says so (`have`, run id ->
n) and gets only the points after them; a curve shorter than what the page holds (a folder
rewritten under it) is sent whole with `from = 0`, which tells the page to start that run
again. With 16 runs of 1,000 steps, the first answer carries 16,000 points (about 300 kB) and
each later one a few.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rlplex.control.job.store import LogRecord
from rlplex.mainjob.frame import node_run, notes
from rlplex.mainjob.view import THROUGHPUT_WINDOW_S, JobView, RunView

SETTING_CHARS = 80  # a setting's value is cut to this (a prompt template need not fill the table)


def _num(value: float | None) -> float | None:
    """JSON has no NaN or infinity: a number that is not finite is sent as unknown."""
    return value if value is not None and math.isfinite(value) else None


def _finite(values: Mapping[str, Any]) -> dict[str, Any]:
    return {key: _num(value) if isinstance(value, float) else value for key, value in values.items()}


def flat_settings(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A run's config as dotted keys and short values: `optim.lr = 0.003`."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flat_settings(value, f"{name}.")
        elif isinstance(value, float):
            flat[name] = float(f"{value:.6g}")  # 0.0003, not 0.00030000000000000003
        elif isinstance(value, bool | int) or value is None:
            flat[name] = value
        else:
            text = str(value)
            flat[name] = text if len(text) <= SETTING_CHARS else text[: SETTING_CHARS - 1] + "…"
    return flat


def eval_score(run: RunView) -> tuple[str, list[float], list[float | None]] | None:
    """(column, steps, scores) of the run's held-out evaluations (`RunView.heldout_scores`), JSON-safe."""
    found = run.heldout_scores()
    return None if found is None else (found[0], found[1], [_num(score) for score in found[2]])


def _curve(run: RunView, have: int) -> dict[str, Any]:
    start = have if 0 <= have <= len(run.curve) else 0
    points = run.curve[start:]
    return {"from": start, "step": [step for step, _ in points], "value": [_num(value) for _, value in points]}


def run_json(view: JobView, run: RunView, restarts: int, have: int) -> dict[str, Any]:
    evaluated = eval_score(run)
    return {
        "id": run.run_id,
        "state": run.state,
        "step": run.trained_steps,
        "max_steps": run.max_steps,
        "reward": _num(run.reward),
        "reward_start": _num(run.reward_start),
        "eval": None if evaluated is None else evaluated[2][-1],
        "eval_column": None if evaluated is None else evaluated[0],
        "tokens_per_s": _num(run.tokens_per_s),
        "staleness": _num(run.policy_lag),
        "restarts": restarts,
        "elapsed_s": _num(view.run_elapsed_s(run)),
        "eta_s": _num(view.run_eta_s(run)),
        "reason": run.reason,
        "doing": run.doing,
        "settings": flat_settings(run.settings),
        "curve": _curve(run, have),
        "eval_curve": None if evaluated is None else {"step": evaluated[1], "value": evaluated[2]},
    }


def _event(record: LogRecord) -> dict[str, Any]:
    if not record.new:  # a decision: entity is its target, old its action
        kind = "restart" if record.old.startswith("RESTART") else "failover" if record.old == "FAILOVER" else "decision"
        return {"at": record.at, "kind": kind, "text": f"{record.old} {record.entity}", "cause": record.cause}
    return {
        "at": record.at,
        "kind": "state",
        "text": f"{record.entity}: {record.old} → {record.new}",
        "cause": record.cause,
    }


def events_json(view: JobView) -> list[dict[str, Any]]:
    """The store's transitions and decisions and each run's admission and end, oldest first."""
    found = [_event(record) for record in view.events]
    for run in view.runs:
        if run.started_at is not None:
            found.append({"at": run.started_at, "kind": "admission", "text": f"{run.run_id} joined", "cause": ""})
        if run.ended_at is not None:
            kind = "eviction" if run.state == "evicted" else "end"
            found.append({"at": run.ended_at, "kind": kind, "text": f"{run.run_id} {run.state}", "cause": run.reason})
    return sorted(found, key=lambda event: event["at"])


def snapshot(view: JobView, kind: str, have: Mapping[str, int], actions: bool) -> dict[str, Any]:
    """The page's JSON for `view` (`have`: run id -> curve points the page holds already)."""
    restarts: dict[str, int] = {}
    nodes = []
    for node in view.nodes:
        run = node_run(view, node)
        if run:
            restarts[run] = restarts.get(run, 0) + node.restarts
        nodes.append({
            "id": node.node_id, "role": node.role, "rank": node.rank, "run": run, "state": node.state,
            "restarts": node.restarts, "heartbeat_age_s": _num(view.read_at - node.last_heartbeat)
            if node.last_heartbeat else None, "progress": _finite(node.progress), "cause": node.cause,
        })  # fmt: skip
    return {
        "kind": kind,
        "folder": str(view.output_dir),
        "read_at": view.read_at,
        "actions": actions,
        "job": {
            "state": view.outcome,
            "master_gone": view.master_gone,
            "elapsed_s": _num(view.elapsed_s),
            "eta_s": _num(view.eta_s),
            "tokens_per_s": _num(view.trainer_tokens_per_s()),
            "tokens_window_s": THROUGHPUT_WINDOW_S,
            "trained_tokens": view.trained_tokens,
        },
        "runs": [run_json(view, run, restarts.get(run.run_id, 0), have.get(run.run_id, 0)) for run in view.runs],
        "nodes": nodes,
        "events": events_json(view)[-200:],
        "notes": notes(view),
        "lines": [*view.rendezvous, *([view.inference.describe(view.runs)] if view.inference is not None else [])],
    }
