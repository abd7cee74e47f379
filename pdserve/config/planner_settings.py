"""The ``planner`` settings section: SLO-driven autoscaling of prefill and decode workers
(:mod:`pdserve.planner.autoscale`; ``pdserve up --autoscale`` and ``pdserve planner``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, model_validator

from pdserve.config.engine_settings import _Section
from pdserve.config.flags import Flag

PLANNING = ("up", "planner")
"""The subcommands that run the planner loop."""


class PlannerSettings(_Section):
    """SLO-driven autoscaling (docs/planning.md).

    Every interval_s the planner reads the router's /metrics (request rate, prompt and output
    lengths, observed TTFT and ITL), predicts with the profile's simulation which worker counts
    within the bounds meet the SLOs, and asks for the fewest that do; observed SLO misses (in
    a window of at least 5 finished requests) add a worker where the prediction adds none, and
    without a profile they are the only rule. Scaling up is immediate, scaling down one worker
    at a time after scale_down_intervals intervals in a row asking for fewer; after any change
    the counts hold for cooldown_s. `pdserve up --autoscale` starts
    and drains its own workers; `pdserve planner` only exports the wanted counts
    (pdserve_planner_desired_workers) for KEDA or an HPA to act on."""

    autoscale: Annotated[bool, Flag("--autoscale", ("up",))] = Field(
        default=False,
        description="run the planner in `pdserve up` and let it start and drain workers "
        "between the min_* and max_* bounds",
    )
    profile: Annotated[Path | None, Flag("--planner-profile", PLANNING)] = Field(
        default=None,
        description="a `pdserve bench profile` file for predictions; unset: react to observed "
        "SLO misses only",
    )
    min_prefill: Annotated[int, Flag("--min-prefill", PLANNING)] = Field(
        default=0, ge=0, description="fewest prefill workers (0: decode workers prefill locally)"
    )
    max_prefill: Annotated[int, Flag("--max-prefill", PLANNING)] = Field(
        default=2, ge=0, description="most prefill workers"
    )
    min_decode: Annotated[int, Flag("--min-decode", PLANNING)] = Field(
        default=1, ge=1, description="fewest decode workers"
    )
    max_decode: Annotated[int, Flag("--max-decode", PLANNING)] = Field(
        default=2, ge=1, description="most decode workers"
    )
    ttft_slo_ms: Annotated[float, Flag("--planner-ttft-slo-ms", PLANNING)] = Field(
        default=2000.0, gt=0, description="time-to-first-token target, ms"
    )
    itl_slo_ms: Annotated[float, Flag("--planner-itl-slo-ms", PLANNING)] = Field(
        default=200.0, gt=0, description="inter-token latency target (90th percentile), ms"
    )
    attainment: Annotated[float, Flag("--planner-attainment", PLANNING)] = Field(
        default=0.9, gt=0, le=1, description="share of requests that must meet both targets"
    )
    interval_s: Annotated[float, Flag("--planner-interval-s", PLANNING)] = Field(
        default=10.0, gt=0, description="seconds between decisions"
    )
    scale_down_intervals: Annotated[int, Flag("--planner-scale-down-intervals", PLANNING)] = Field(
        default=3,
        ge=1,
        description="intervals in a row asking for fewer workers before one is drained",
    )
    cooldown_s: Annotated[float, Flag("--planner-cooldown-s", PLANNING)] = Field(
        default=60.0,
        ge=0,
        description="after a change, seconds before the next one (a "
        "starting worker loads the model and a draining one migrates: the windows in between "
        "measure neither)",
    )
    port: Annotated[int, Flag("--planner-port", PLANNING)] = Field(
        default=8300,
        ge=0,
        le=65535,
        description="port of the planner's own /metrics (0: none)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> PlannerSettings:
        if self.min_prefill > self.max_prefill or self.min_decode > self.max_decode:
            raise ValueError(
                f"planner bounds: min_prefill {self.min_prefill} <= max_prefill "
                f"{self.max_prefill} and min_decode {self.min_decode} <= max_decode "
                f"{self.max_decode} must hold"
            )
        return self
