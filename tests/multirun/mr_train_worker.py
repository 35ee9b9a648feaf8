"""One rank of a two-rank MultiRunTrainer: `python mr_train_worker.py train RANK WORLD PORT DIR`.

Trains RUNS together in DIR/iso (rank 0 writes their rollouts), then resumes run_r in
DIR/resume (prepared by the test at world size 1) to step 4. Writes DIR/result_<rank>.json.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
# Run as a script: tests/multirun is on sys.path, tests/ (lm_models) is not.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from mr_train_helpers import PACKED, RUNS, STEPS, make_runs, make_trainer, train_until  # noqa: E402


def main() -> None:
    out = Path(sys.argv[5])
    rank, world, port = (int(arg) for arg in sys.argv[2:5])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        iso = out / "iso"
        if rank == 0:
            iso.mkdir()
            make_runs(iso, list(RUNS))
        dist.barrier()  # the test's set-up, not the trainer's protocol
        trainer = make_trainer(iso, 4, micro_tokens=PACKED["micro_tokens"], micro_batches=1)
        train_until(trainer, dict.fromkeys(RUNS, STEPS))
        slots = dict(sorted(trainer.manager.id_2_idx.items()))
        resumed = make_trainer(out / "resume", 3, **PACKED)
        resumed.iteration()
        slot = resumed.manager.id_2_idx["run_r"]
        resume = {"resume_slot": slot, "resume_step": resumed.manager.resume_step(slot)}
        train_until(resumed, {"run_r": 4})
    except BaseException:
        (out / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise
    (out / f"result_{rank}.json").write_text(json.dumps({"slots": slots, **resume}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
