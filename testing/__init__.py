"""Fixtures for tests and benchmarks, shared by the test suites of every package. Never imported by
the service or the node.

- ``verifier``: scratch databases (SQLite or the PostgreSQL of NEUROSHARD_TEST_DATABASE_URL),
  a settable clock, signed request bodies.
- ``api``: the verifier's FastAPI app on a scratch database with a hand-moved clock, signed
  requests through Starlette's TestClient, and a verifier process on loopback.
"""
