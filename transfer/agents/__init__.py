"""pdserve.transfer.agents."""
