"""Colocated worker: prefill and decode in one engine, no KV transfer (the aggregated
baseline, and what ``pdserve up --colocated N`` runs). Its one route, ``POST
/internal/generate``, and its request logic are the decode worker's
(:func:`~pdserve.workers.roles.decode.add_generate_route`,
:class:`~pdserve.workers.roles.decode.DecodeHandler` without a transceiver): every request is
prefilled here (engine mode ``full``), then decoded; a migrated request (``resume``) runs its
listed choices here, and a draining colocated worker migrates its running streams elsewhere as
a decode worker does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fastapi import APIRouter

from pdserve.protocol import Role
from pdserve.workers.roles.decode import DecodeHandler, add_generate_route
from pdserve.workers.roles.service import WorkerIdentity, WorkerService

if TYPE_CHECKING:
    from pdserve.config.loading import WorkerConfig
    from pdserve.discovery import Registration
    from pdserve.workers.engine.api import WorkerEngine


class ColocatedWorker(WorkerService):
    """Colocated baseline: prefill and decode in one engine, no KV transfer."""

    role: ClassVar[Role] = Role.COLOCATED

    def __init__(
        self,
        *,
        cfg: WorkerConfig,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        registration: Registration,
    ) -> None:
        super().__init__(cfg=cfg, identity=identity, engine=engine, registration=registration)
        self.handler = DecodeHandler(
            engine=engine,
            transceiver=None,
            metrics=self.metrics,
            scheduler=cfg.engine.scheduler,
            transfer=cfg.transfer,
        )

    def on_deregistered(self) -> None:
        """Drain (``worker.migrate_on_drain``): migrate the running streams elsewhere."""
        if self.cfg.worker.migrate_on_drain:
            self.handler.migrate_all()

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        add_generate_route(api)
