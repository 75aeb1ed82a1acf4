"""The verifier's HTTP API (FastAPI) and the dashboard it serves at /."""
