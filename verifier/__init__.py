"""The verification service: tracker, signed receipts, hash agreement, reputation, measured
loss and the training verdict, spot checks, and the database they live in.

The HTTP surface is `neuroshard.api`; this package knows nothing of FastAPI.
"""
