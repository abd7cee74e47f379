"""pdserve.transfer.formatter."""
