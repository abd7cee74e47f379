"""The seed's *Connection*: the control connection between two transceivers and what happens
first on it.

- ``control``: :class:`~pdserve.transfer.connection.control.Connection`, framed messages and
  raw byte streams over one TCP connection
- ``auth``: mutual challenge-response on the cluster secret, first thing on every connection
- ``handshake``: the first exchange: who is talking, in which layout, over which backend
- ``admission``: unproven peers never take a proven peer's slot
"""
