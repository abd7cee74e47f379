"""Colocated worker: prefill and decode in one engine, no KV hand-off (the aggregated
baseline, and what ``pdserve up --colocated N`` runs); its transceiver lends prefix blocks to
peers and pulls lent ones (:mod:`.lending`). Its one route, ``POST
/internal/generate``, and its request logic are the decode worker's
(:func:`~pdserve.workers.roles.decode.add_generate_route`,
:class:`~pdserve.workers.roles.decode.DecodeHandler` without a transceiver): every request is
prefilled here (engine mode ``full``), then decoded; a migrated request (``resume``) runs its
listed choices here, and a draining colocated worker migrates its running streams elsewhere as
a decode worker does.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fastapi import APIRouter

from pdserve.protocol import Role
from pdserve.workers.roles.decode import DecodeHandler, add_generate_route
from pdserve.workers.roles.kv_transfer import TransferWorker


class ColocatedWorker(TransferWorker):
    """Colocated baseline: prefill and decode in one engine; its transceiver moves only
    prefix blocks (lent to peers, or pulled from them before a prefill)."""

    role: ClassVar[Role] = Role.COLOCATED

    def __init__(self, **parts: Any) -> None:
        super().__init__(**parts)
        self.handler = DecodeHandler(
            engine=self.engine,
            transceiver=None,  # a hand-off's handle is refused here
            metrics=self.metrics,
            scheduler=self.cfg.engine.scheduler,
            transfer=self.cfg.transfer,
            puller=self.puller,
        )

    def on_deregistered(self) -> None:
        """Drain (``worker.migrate_on_drain``): migrate the running streams elsewhere."""
        if self.cfg.worker.migrate_on_drain:
            self.handler.migrate_all()

    @classmethod
    def add_role_routes(cls, api: APIRouter) -> None:
        super().add_role_routes(api)  # /internal/kv/lend
        add_generate_route(api)
