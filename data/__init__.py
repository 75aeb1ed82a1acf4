"""Data path: signed manifests, deterministic shard assignment, verified shard loading, publishing."""

from .assign import assign_shards
from .dataset import Dataset, open_dataset
from .keys import PublisherKeyError, load_or_create_signing_key, parse_public_key
from .manifest import Manifest, ManifestError, ShardInfo, TokenizerInfo, read_manifest
from .shards import BatchStream, DataPosition, LocalShardSource, ShardError, ShardSource, load_shard

__all__ = [
    "BatchStream",
    "DataPosition",
    "Dataset",
    "LocalShardSource",
    "Manifest",
    "ManifestError",
    "PublisherKeyError",
    "ShardError",
    "ShardInfo",
    "ShardSource",
    "TokenizerInfo",
    "assign_shards",
    "load_or_create_signing_key",
    "load_shard",
    "open_dataset",
    "parse_public_key",
    "read_manifest",
]
