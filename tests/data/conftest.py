"""Data-path tests use the shared S3 fixtures of tests/conftest.py (`endpoint`, `aws_env`)."""
