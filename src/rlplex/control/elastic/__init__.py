"""Elastic training (seed 003's sub-master driven pattern): the `ElasticMaster` sub-master, its
`ElasticWorker` ranks running a script or a function (`entry`) under torchrun's environment, the
rendezvous as data (`rdzv`) and the per-node check (`check`).

`rlplex.control.elastic:ElasticMaster` and `:ElasticWorker` are the entry points job files name;
they resolve on first use, so `python -m rlplex.control.elastic.entry` loads neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlplex.lazy import lazy_getattr

if TYPE_CHECKING:
    from rlplex.control.elastic.master import ElasticMaster
    from rlplex.control.elastic.worker import ElasticWorker

_WHERE = {"ElasticMaster": "master", "ElasticWorker": "worker"}
__all__ = ["ElasticMaster", "ElasticWorker"]

__getattr__ = lazy_getattr(__name__, _WHERE)
