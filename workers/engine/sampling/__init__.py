"""pdserve.workers.engine.sampling."""
