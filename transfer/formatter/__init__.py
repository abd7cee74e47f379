"""The seed's *Formatter*: which bytes of the prefill pool go to which bytes of the decode pool,
and the work of producing them in the layout the decode side expects.

- ``mapping``: :class:`~pdserve.transfer.formatter.mapping.Formatter`, negotiated once per
  peer: the layout mapping and the block runs of a transfer (refuses what it cannot map)
- ``convert``: the re-block/dtype conversion kernel on the sending side
- ``staging``: the staging buffers a converting send reads from
- ``hoststage``: plan segments between CUDA memory and pinned host memory (TCP, digests)
- ``copies``: how many times a transfer's KV bytes are copied on the way, counted where the
  copies happen
"""
