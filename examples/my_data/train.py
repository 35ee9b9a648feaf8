"""The quickstart from Python: the same job as `job.toml`, built from objects (a `datasets.Dataset`
and the reward function itself), run, and its trained model exported.

    python examples/my_data/train.py                      # after `rlplex model smollm2 outputs/models/smollm2-135m`
    python examples/my_data/train.py --steps 5 --model Qwen/Qwen2.5-0.5B-Instruct

The reward is imported from `my_reward.py` beside this script (the script's folder is on the
path of every process the job starts), never defined here: the job's processes import it by name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets import load_dataset
from my_reward import exact_number

from rlplex.mainjob.api import main_job, run, run_job

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="outputs/models/smollm2-135m", help="hub id or save_pretrained folder")
    parser.add_argument("--output", default="outputs/my-data-py", help="the job's folder (a new one)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()

    dataset = load_dataset("json", data_files=str(HERE / "problems.jsonl"), split="train")
    job = main_job(
        "my-data-py",
        args.output,
        model=args.model,
        trainer={"world_size": 1},
        runs=[
            run(
                "run_mine",
                data=dataset,
                reward=exact_number,
                messages_field="messages",
                max_new_tokens=args.max_new_tokens,
                max_steps=args.steps,
                batch_size=args.batch_size,
                group_size=4,
                optim={"lr": 1e-3},
                temperature=0.7,
                model={"lora": {"rank": 8, "alpha": 16.0}},
            )
        ],
    )
    result = run_job(job)
    mine = result.runs["run_mine"]
    rewards = f"reward {mine.rewards[0]:.3f} -> {mine.rewards[-1]:.3f}" if mine.rewards else "no reward yet"
    print(f"{result.outcome}: run_mine trained {mine.trained_steps} steps, {rewards}; report: {result.report}")
    print(f"model: {result.export('run_mine', Path(args.output) / 'model', merge=True)}")


if __name__ == "__main__":
    main()
