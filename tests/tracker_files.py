"""Reading back what the trackers wrote, from their own files: TensorBoard's event files
(through TensorBoard's reader) and the records of a W&B run's offline `.wandb` file.

wandb 0.31 writes them from its Go core and ships no Python reader, so this reads the format
itself: a 7-byte header (`:W&B`, a 2-byte magic, a version), then LevelDB's log format (blocks
of 32 KiB; each record a 7-byte header of CRC-32C, length and kind (full, first, middle,
last)), each record a protobuf `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the event files of `directory`, as (step, value) in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    out, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        room = BLOCK - offset % BLOCK
        if room < 7:  # a block's tail too short for a header is padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            break  # zeroes: the end of what was written
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """Each `run.log` call's row, keys to values."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def run_record(path: Path) -> Any:
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")
