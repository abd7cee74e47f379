"""pdserve.transfer.integrity."""
