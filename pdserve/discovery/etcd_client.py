"""An ``aetcd`` client with TLS and a user: aetcd 1.0 only opens plaintext gRPC channels.

:class:`SecureClient` is ``aetcd.Client`` with ``connect()`` opening
``grpc.aio.secure_channel`` with the credentials of a
:class:`~pdserve.discovery.tls.ControlPlaneTLS` (CA, client certificate and key; a plaintext
channel when TLS is off), then, as aetcd does, authenticating the etcd user (if any) over that
channel. Unlike aetcd it closes the channel when authentication fails (a retry loop would
otherwise leak one channel per try). Every other method is aetcd's. Imported only when etcd is
used with TLS or a user (it loads aetcd and gRPC).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
from aetcd import exceptions, rpc, watcher

from pdserve.discovery.tls import ControlPlaneTLS


class SecureClient(aetcd.Client):  # type: ignore[misc]  # aetcd is untyped
    """``aetcd.Client`` whose channel is TLS when ``tls`` enables it (mutual TLS with a client
    certificate) and which logs in as ``tls.etcd_username`` when set.

    ``timeout_s``: each RPC's deadline, seconds. Errors are aetcd's (``ConnectionFailedError``
    when the handshake fails: wrong CA, no or refused client certificate;
    ``UnauthenticatedError`` / ``InvalidArgumentError`` for a refused user or password).
    """

    _is_connecting: bool  # aetcd's, set in its __init__

    def __init__(
        self,
        tls: ControlPlaneTLS,
        *,
        host: str,
        port: int,
        timeout_s: float,
        options: dict[str, Any],
    ) -> None:
        super().__init__(
            host=host,
            port=port,
            username=tls.etcd_username,
            password=tls.etcd_password,
            timeout=timeout_s,
            options=options,
        )
        self._credentials = tls.grpc_credentials()  # None: plaintext

    async def connect(self) -> None:
        """Open the TLS channel (and authenticate the user); idempotent, as aetcd's."""
        try:
            await self._connect()
        except rpc.AioRpcError as exc:
            exceptions._handle_exception(exc)

    async def _connect(self) -> None:
        # aetcd 1.0.0's Client.connect, with secure_channel in place of insecure_channel.
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self._credentials is None:
                self.channel = rpc.insecure_channel(target, options=options)
            else:
                self.channel = rpc.secure_channel(target, self._credentials, options=options)
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                try:
                    resp = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                except BaseException:
                    channel, self.channel = self.channel, None
                    await channel.close()
                    raise
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False
