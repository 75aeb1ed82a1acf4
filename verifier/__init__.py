"""The verification service: tracker, signed receipts, hash agreement, reputation, measured
loss and the training verdict, spot checks, membership and the stages' vocabulary schedule
(verifier.vocab), and the database they live in.

The HTTP surface is `neuroshard.api`; this package knows nothing of FastAPI.
"""
