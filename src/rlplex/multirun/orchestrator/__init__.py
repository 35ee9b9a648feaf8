"""One orchestrator per run (seed 001): the loop that generates, scores and hands rollouts to the
shared trainer (`loop`), its config in the run's `control/orch.toml` (`config`), the RL step as
a dataflow graph (`graph`, `models`) and the sampling policy (`policy`, `hf_engine`).
`python -m rlplex.multirun.orchestrator OUTPUT_DIR RUN_ID ORCH.toml` runs it standalone."""
