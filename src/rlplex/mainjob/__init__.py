"""The main job: many RL runs on one elastic trainer, placed and healed by the PrimeMaster.

`rlplex run FILE` turns a `MainJobConfig` into a control-plane job of three roles: the
trainer (an `ElasticMaster` and its ranks, each running `rlplex.multirun.trainer`), one
orchestrator node per run, and a conductor driver that plays the job's scripted events
(a run added, a run evicted) and ends the job when every run is done. This layer sits
above `control`, `dataflow` and `multirun`; the CLI is its only user.
"""
