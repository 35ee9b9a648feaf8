"""Drawing a `JobView` into the size it is given: the live view of `rlplex run` (fitted to the
terminal on every redraw, so a resized terminal gets a fitted frame) and the frame `rlplex
status` prints (every row, every note in full).

```
job RUNNING · elapsed 12m03s · ETA 4m10s             the job line
trainer: 1234 tokens/s (last 30 s), 98765 tokens trained
run    state    step   reward  at start  ...  ETA    one line per run
notes: run_b evicted: bad rollouts: rewards hol…     reasons, under the table, cut to the width
role   rank  run  state  restarts  heartbeat  ...    one line per node
inference: ..., rendezvous: ...
```

No cell wraps: a table too wide for the terminal shrinks its flexible columns (cut with "…"),
then drops its least needed columns. When the terminal is too short, lines go first to the job
line, then the runs, then the nodes (keeping room for two notes), then the notes, then the rest;
what does not fit is counted on a "+N more" line instead of being cut off at the bottom.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from rlplex.control.job.states import NodeState
from rlplex.control.job.store import NodeRecord
from rlplex.mainjob.timing import format_duration
from rlplex.mainjob.view import THROUGHPUT_WINDOW_S, JobView, RunView

# Room the nodes table leaves for the notes when the terminal is short.
NOTE_RESERVE = 2
HEADER_STYLE = "bold"
T = TypeVar("T")


@dataclass(frozen=True)
class Column:
    header: str
    keep: int = 0  # a too-wide table drops its lowest `keep` first; 0: never dropped
    shrink_to: int = 0  # > 0: may be cut (with "…") down to this width before a column is dropped
    right: bool = False


def _cell(text: str, width: int, right: bool) -> Text:
    cell = Text(text)
    cell.truncate(width, overflow="ellipsis")
    cell.align("right" if right else "left", width)
    return cell


def fit_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> list[Text]:
    """The header and one line per row, each at most `width` cells wide."""
    natural = [max([Text(column.header).cell_len, *(Text(row[i]).cell_len for row in rows)])
               for i, column in enumerate(columns)]  # fmt: skip
    least = [min(n, c.shrink_to) if c.shrink_to else n for n, c in zip(natural, columns, strict=True)]
    shown = list(range(len(columns)))

    def span(widths: list[int], gap: int) -> int:
        return sum(widths[i] for i in shown) + gap * (len(shown) - 1)

    gap = 2 if span(natural, 2) <= width else 1
    while span(least, gap) > width and any(columns[i].keep for i in shown):
        shown.remove(min((i for i in shown if columns[i].keep), key=lambda i: columns[i].keep))
    widths, excess = list(natural), span(natural, gap) - width
    for i in reversed(shown):  # the rightmost flexible column gives way first
        cut = min(max(excess, 0), natural[i] - least[i])
        widths[i], excess = widths[i] - cut, excess - cut
    lines = []
    for cells, style in ((tuple(c.header for c in columns), HEADER_STYLE), *((row, "") for row in rows)):
        line = _line("", style)
        for n, i in enumerate(shown):
            line.append(" " * gap if n else "")
            line.append_text(_cell(cells[i], widths[i], columns[i].right))
        line.rstrip()
        lines.append(line)
    return lines


def _line(text: str, style: str = "") -> Text:
    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def _take(lines: list[Text], room: int, what: str, states: Sequence[str] = (), header: bool = True) -> list[Text]:
    """`lines` in at most `room` lines: the header (the first line, if `header`) stays and the
    last line counts the rows that did not fit, with a tally of their `states` if given."""
    if len(lines) <= room:
        return lines
    body, kept = len(lines) - header, room - 1 - header  # rows, and how many of them are shown
    hidden = Counter(states[max(kept, 0) :])
    tally = f" ({', '.join(f'{n} {state}' for state, n in sorted(hidden.items()))})" if hidden else ""
    if room <= 0:
        return []
    if kept <= 0:  # a header alone says nothing: one line counts them all
        return [_line(f"{body} {what}{tally}" if header else f"+{body} more {what}", "dim")]
    return [*lines[: header + kept], _line(f"+{body - kept} more {what}{tally}", "dim")]


# When rows must be left out, these come first: what may still change, or went wrong.
RUN_ATTENTION = {"running": 0, "evaluating": 0, "waiting": 1, "evicted": 2, "rejected": 3, "finished": 4}
NODE_ATTENTION: dict[str, int] = {
    NodeState.FAILED: 0,
    NodeState.PENDING: 1,
    NodeState.CREATED: 1,
    NodeState.CHECKED: 1,
    NodeState.RUNNING: 2,
    NodeState.STOPPED: 3,
    NodeState.FINISHED: 3,
}


RUN_COLUMNS = (
    Column("run", shrink_to=12),
    Column("state"),
    Column("step", right=True),
    Column("reward", keep=7, right=True),
    Column("at start", keep=4, right=True),
    Column("held-out", keep=6, right=True),
    Column("tokens/s", keep=5, right=True),
    Column("s/step", keep=3, right=True),
    Column("elapsed", keep=8, right=True),
    Column("ETA", keep=9, right=True),
)
NODE_COLUMNS = (
    Column("role"),
    Column("rank", keep=6, right=True),
    Column("run", keep=8, shrink_to=8),
    Column("state"),
    Column("restarts", keep=7, right=True),
    Column("heartbeat", keep=5, right=True),
    Column("progress", keep=2, shrink_to=12),
)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def job_lines(view: JobView) -> list[Text]:
    state = view.outcome + (" (its master is gone)" if view.master_gone else "")
    elapsed, eta = format_duration(view.elapsed_s), format_duration(view.eta_s)
    rate = view.trainer_tokens_per_s()
    window = f"last {THROUGHPUT_WINDOW_S:.0f} s"
    trainer = f"trainer: {_fmt(rate, '.0f')} tokens/s ({window}), {view.trained_tokens} tokens trained"
    return [_line(f"job {state} · elapsed {elapsed} · ETA {eta}", "bold"), _line(trainer)]


def run_rows(view: JobView, runs: Sequence[RunView]) -> list[list[str]]:
    rows = []
    for run in runs:
        eta = "done" if run.state == "finished" else format_duration(view.run_eta_s(run))
        rows.append([
            run.run_id, run.state, f"{run.trained_steps}/{run.max_steps}", _fmt(run.reward), _fmt(run.reward_start),
            _fmt(run.heldout), _fmt(run.tokens_per_s, ".0f"), _fmt(run.seconds_per_step, ".1f"),
            format_duration(view.run_elapsed_s(run)), eta,
        ])  # fmt: skip
    return rows


def node_rows(view: JobView, nodes: Sequence[NodeRecord]) -> list[list[str]]:
    rows = []
    for node in nodes:
        age = f"{view.read_at - node.last_heartbeat:.1f} s" if node.last_heartbeat else "-"
        progress = ", ".join(f"{k}={v:g}" for k, v in list(node.progress.items())[:4]) or "-"
        rows.append([node.role, str(node.rank), node_run(view, node), node.state, str(node.restarts), age, progress])
    return rows


def node_run(view: JobView, node: NodeRecord) -> str:
    """The run a node works for ("": the whole job)."""
    # Orchestrator rank r serves entry r of the registry, the order of `view.runs`; rollout
    # rank r generates for the run `registry.rollout_slots` names.
    if node.role == "orchestrator" and node.rank < len(view.runs):
        return view.runs[node.rank].run_id
    if node.role == "rollout" and node.rank < len(view.rollout_runs):
        return view.rollout_runs[node.rank]
    return ""


def notes(view: JobView) -> list[str]:
    """What does not fit in a cell: why runs ended early, and the job's own trouble."""
    found = [f"{run.run_id} {run.state}: {' '.join(run.reason.split())}" for run in view.runs if run.reason]
    # Until a run's first step, its row says little: say what its orchestrator is doing.
    found += [f"{run.run_id}: {run.doing}" for run in view.runs if run.doing and run.reward is None]
    if view.master_gone:
        found.append(f"job: its master (pid {view.master_pid}) is gone: `rlplex resume {view.output_dir}`")
    if view.job_cause:
        found.append(f"job cause: {view.job_cause}")
    return found


def frame_lines(view: JobView, width: int, height: int | None) -> list[Text]:
    """The frame in `width` columns; in `height` lines when given (notes then cut to one line each)."""
    head = job_lines(view)
    texts = [f"note: {text}" for text in notes(view)]
    rest = [*view.rendezvous, *([view.inference.describe(view.runs)] if view.inference is not None else [])]
    if height is None:
        runs = fit_table(RUN_COLUMNS, run_rows(view, view.runs), width)
        nodes = fit_table(NODE_COLUMNS, node_rows(view, view.nodes), width) if view.nodes else []
        folded = [Text(text, overflow="fold") for text in texts], [Text(text, overflow="fold") for text in rest]
        return [*head, *runs, *folded[0], *nodes, *folded[1]]
    head = head[:height]
    room = height - len(head)
    runs_room = room - (1 if view.nodes and len(view.runs) + 1 >= room > 2 else 0)  # a line to count the nodes
    run_order = _by_attention(view.runs, runs_room - 1, lambda run: RUN_ATTENTION.get(run.state, 0))
    runs = _take(fit_table(RUN_COLUMNS, run_rows(view, run_order), width), runs_room, "runs",
                 [run.state for run in run_order])  # fmt: skip
    room -= len(runs)
    nodes_room = max(room - min(len(texts), NOTE_RESERVE), min(room, 1))
    node_order = _by_attention(view.nodes, nodes_room - 1, lambda node: NODE_ATTENTION.get(node.state, 0))
    nodes = fit_table(NODE_COLUMNS, node_rows(view, node_order), width) if view.nodes else []
    nodes = _take(nodes, nodes_room, "nodes", [node.state for node in node_order])
    room -= len(nodes)
    noted = _take([_line(text) for text in texts], room, "notes (`rlplex status` has them all)", header=False)
    room -= len(noted)
    extra = _take([_line(text) for text in rest], room, "lines", header=False)
    return [*head, *runs, *noted, *nodes, *extra]


def _by_attention(items: Sequence[T], room: int, rank: Callable[[T], int]) -> list[T]:
    """`items` as they are when all fit in `room` lines; otherwise those needing attention first."""
    return list(items) if len(items) <= room else sorted(items, key=rank)


@dataclass
class JobFrame:
    """A `JobView` as rich draws it: in the console's width, and its height when `fit_height`."""

    view: JobView
    fit_height: bool = False

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = (options.height or options.size.height) if self.fit_height else None
        yield from self._lines(options.max_width, height)

    def _lines(self, width: int, height: int | None) -> Iterator[Text]:
        for line in frame_lines(self.view, max(width, 20), height):
            line.end = "\n"
            yield line


def render(view: JobView, live: bool = False) -> JobFrame:
    """The frame of `view`: `live`, fitted to the terminal's height too (the `rlplex run` view);
    otherwise every row and every note in full, as `rlplex status` prints it."""
    return JobFrame(view, fit_height=live)
