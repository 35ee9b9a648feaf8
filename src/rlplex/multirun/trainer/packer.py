"""The packer: which rollout rows of which runs go into this iteration's micro-batches.

Fairness is by loss tokens, not by turns: each run has a `served` count of loss tokens
packed so far, and the next row always comes from the run with the least served (ties to
the lower slot). A run with long samples therefore gets fewer rows per iteration than a run
with short ones, and a run with a big step cannot starve the others: its step simply spans
several iterations. Gradients of a partly packed step accumulate in the adapter's `.grad`
until every row of the step has been through forward and backward; only then does the run
step its optimizer (`Plan.completes`). A run that joins starts at the lowest `served` of the
runs already waiting, so it cannot claim a backlog of tokens it was never owed.

`MicroBatch` is one padded batch of rows from any mix of runs: every row carries its slot
(`adapter_ids`) and the weight `1 / N_k` of its tokens, where N_k is the number of loss
tokens in run k's whole step, so that the loss of run k over the step is a per-run mean
whatever it is packed with.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch

from rlplex.multirun.rundir.rollouts import RolloutBatch


@dataclass
class PendingStep:
    """One run's step being consumed: the rows before `cursor` have been packed."""

    idx: int
    batch: RolloutBatch
    cursor: int = 0
    row_loss_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.row_loss_tokens:
            self.row_loss_tokens = self.batch.loss_mask.sum(dim=1).tolist()

    @property
    def step(self) -> int:
        return self.batch.step

    @property
    def width(self) -> int:
        return int(self.batch.tokens.shape[1])

    @property
    def remaining(self) -> int:
        return self.batch.n - self.cursor


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of the pending step of slot `idx`."""

    idx: int
    start: int
    stop: int


@dataclass
class Plan:
    micro_batches: list[list[Piece]]
    completes: list[int]
    """Slots whose step has now been packed whole: they step their optimizers after this iteration."""


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # int64 [B, L]
    attention: torch.Tensor  # int64 [B, L]
    loss_mask: torch.Tensor  # bool [B, L]
    logprobs: torch.Tensor  # float32 [B, L]
    advantages: torch.Tensor  # float32 [B]
    token_weight: torch.Tensor  # float32 [B]: 1 / loss tokens of the row's whole step
    adapter_ids: torch.Tensor  # int64 [B]

    def to_wire(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat tensors (int64, float32) for a collective: no pickle between ranks."""
        ints = torch.cat(
            [
                torch.stack([self.tokens, self.attention, self.loss_mask.long()], dim=1).reshape(-1),
                self.adapter_ids,
            ]
        )
        floats = torch.cat([self.logprobs.reshape(-1), self.advantages, self.token_weight])
        return ints, floats

    @classmethod
    def wire_sizes(cls, rows: int, width: int) -> tuple[int, int]:
        return rows * (3 * width + 1), rows * (width + 2)

    @classmethod
    def from_wire(cls, ints: torch.Tensor, floats: torch.Tensor, rows: int, width: int) -> MicroBatch:
        per_token = ints[: rows * 3 * width].view(rows, 3, width)
        logprobs = floats[: rows * width].view(rows, width)
        return cls(
            tokens=per_token[:, 0].contiguous(),
            attention=per_token[:, 1].contiguous(),
            loss_mask=per_token[:, 2].bool(),
            logprobs=logprobs.contiguous(),
            advantages=floats[rows * width : rows * width + rows].clone(),
            token_weight=floats[rows * width + rows :].clone(),
            adapter_ids=ints[rows * 3 * width :].clone(),
        )


class Packer:
    """Master-side state: the pending step of each run and the loss tokens served to each."""

    def __init__(self, micro_tokens: int, micro_batches: int, pad_id: int = 0) -> None:
        if micro_tokens < 1 or micro_batches < 1:
            raise ValueError(f"micro_tokens={micro_tokens}, micro_batches={micro_batches}: both must be >= 1")
        self.micro_tokens = micro_tokens
        self.micro_batches = micro_batches
        self.pad_id = pad_id
        self.pending: dict[int, PendingStep] = {}
        self.served: dict[int, int] = {}

    def add(self, idx: int, batch: RolloutBatch) -> None:
        if idx in self.pending:
            raise ValueError(f"slot {idx} already has step {self.pending[idx].step} pending")
        waiting = [self.served[i] for i in self.pending if i in self.served]
        floor = min(waiting) if waiting else max(self.served.values(), default=0)
        self.served[idx] = max(self.served.get(idx, 0), floor)
        self.pending[idx] = PendingStep(idx, batch)

    def drop(self, idx: int) -> None:
        """Forget a run (deleted or evicted): its partly packed step is abandoned."""
        self.pending.pop(idx, None)
        self.served.pop(idx, None)

    def has_work(self) -> bool:
        return any(p.remaining > 0 for p in self.pending.values())

    def plan(self) -> Plan:
        """Fill up to `micro_batches` micro-batches of about `micro_tokens` row tokens each."""
        heap = [(self.served[idx], idx) for idx, p in self.pending.items() if p.remaining > 0]
        heapq.heapify(heap)
        micros: list[list[tuple[int, int]]] = [[]]
        cost = 0
        while heap:
            served, idx = heapq.heappop(heap)
            step = self.pending[idx]
            if micros[-1] and cost + step.width > self.micro_tokens:
                if len(micros) == self.micro_batches:
                    break
                micros.append([])
                cost = 0
            row = step.cursor
            micros[-1].append((idx, row))
            cost += step.width
            step.cursor += 1
            served += step.row_loss_tokens[row]
            self.served[idx] = served
            if step.remaining > 0:
                heapq.heappush(heap, (served, idx))
        completes = sorted(idx for idx, p in self.pending.items() if p.remaining == 0)
        return Plan([_coalesce(m) for m in micros if m], completes)

    def finish(self, idx: int) -> PendingStep:
        """Remove the step of a run that `plan()` reported complete."""
        step = self.pending.pop(idx)
        if step.remaining:
            raise ValueError(f"slot {idx}: step {step.step} still has {step.remaining} rows to pack")
        return step

    def materialize(self, pieces: list[Piece]) -> MicroBatch:
        """Gather the rows of `pieces` into one right-padded batch (before `finish` of their steps)."""
        width = max(self.pending[p.idx].width for p in pieces)
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("tok", "att", "mask", "lp", "adv", "w", "ids")}
        for piece in pieces:
            step = self.pending[piece.idx]
            b, rows = step.batch, slice(piece.start, piece.stop)
            pad = width - step.width
            parts["tok"].append(torch.nn.functional.pad(b.tokens[rows], (0, pad), value=self.pad_id))
            parts["att"].append(torch.nn.functional.pad(b.attention[rows], (0, pad)))
            parts["mask"].append(torch.nn.functional.pad(b.loss_mask[rows], (0, pad)))
            parts["lp"].append(torch.nn.functional.pad(b.logprobs[rows], (0, pad)))
            parts["adv"].append(b.advantages[rows])
            n = piece.stop - piece.start
            parts["w"].append(torch.full((n,), 1.0 / b.n_tokens, dtype=torch.float32))
            parts["ids"].append(torch.full((n,), piece.idx, dtype=torch.int64))
        return MicroBatch(*(torch.cat(parts[k]) for k in ("tok", "att", "mask", "lp", "adv", "w", "ids")))


def _coalesce(rows: list[tuple[int, int]]) -> list[Piece]:
    """(slot, row) pairs to contiguous pieces, grouped by slot (rows of a slot come in order)."""
    by_slot: dict[int, list[int]] = {}
    for idx, row in rows:
        by_slot.setdefault(idx, []).append(row)
    pieces = []
    for idx, slot_rows in sorted(by_slot.items()):
        start = prev = slot_rows[0]
        for row in slot_rows[1:]:
            if row != prev + 1:
                pieces.append(Piece(idx, start, prev + 1))
                start = row
            prev = row
        pieces.append(Piece(idx, start, prev + 1))
    return pieces
