"""`[dashboard]` of a main job and `rlplex dashboard`'s flags (no web imports: every job file loads it)."""

from __future__ import annotations

from pydantic import Field

from rlplex.config import StrictModel


class DashboardConfig(StrictModel):
    """`[dashboard]` of a main job, and `rlplex dashboard`'s flags."""

    enabled: bool = Field(False, description="the master serves the dashboard while the job runs")
    host: str = Field("127.0.0.1", min_length=1, description="address to listen on; loopback unless said")
    port: int = Field(0, ge=0, le=65535, description="0: any free port (the link names it)")
    allow_actions: bool = Field(False, description="the page may add and evict runs and stop the job (each confirmed)")
