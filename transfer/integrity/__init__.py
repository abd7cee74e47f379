"""Block digests: the sender's record of the KV bytes it moved, checked where they landed.

- ``digests``: the digest of each transferred block (xxh3 by default), checked on arrival; a
  mismatch fails the request
- ``mix64``: a block digest computed where the KV bytes live, GPU memory included
"""
