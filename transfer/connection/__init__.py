"""pdserve.transfer.connection."""
