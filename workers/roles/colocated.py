"""Colocated worker: prefill and decode in one engine, no KV transfer (the aggregated
baseline, and what ``pdserve up --colocated N`` runs). Its one route, ``POST
/internal/generate``, and its request logic are the decode worker's
(:func:`~pdserve.workers.roles.decode.add_generate_route`,
:class:`~pdserve.workers.roles.decode.DecodeHandler` without a transceiver): every request is
prefilled here (engine mode ``full``), then decoded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fastapi import APIRouter

from pdserve.protocol import Role
from pdserve.workers.roles.decode import add_generate_route, decode_handler
from pdserve.workers.roles.service import RoleSettings, WorkerIdentity, WorkerService

if TYPE_CHECKING:
    from pdserve.discovery import Registration
    from pdserve.workers.engine.api import WorkerEngine


class ColocatedWorker(WorkerService):
    """Colocated baseline: prefill and decode in one engine, no KV transfer."""

    role: ClassVar[Role] = Role.COLOCATED

    def __init__(
        self,
        *,
        settings: RoleSettings,
        identity: WorkerIdentity,
        engine: WorkerEngine,
        registration: Registration,
    ) -> None:
        super().__init__(
            settings=settings, identity=identity, engine=engine, registration=registration
        )
        self.handler = decode_handler(settings, engine, None, self.metrics)

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        add_generate_route(api)
