"""OpenAI-compatible HTTP API (FastAPI app factory, schemas, SSE)."""
