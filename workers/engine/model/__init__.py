"""pdserve.workers.engine.model."""
