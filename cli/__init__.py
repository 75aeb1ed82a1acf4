"""The composition roots of the node and verifier processes, and the publishers' command lines.

- ``node``: `neuroshard-node`: flags → typed configs → the node's parts, wired once; starts an
  embedded verifier (``embedded``) for the one-command default.
- ``verifier``: `neuroshard-verifier`: the verifier's workers, database and API.
- ``embedded``: the verifier and its API inside a node process (SQLite under the node's home).
- ``publish_shards``, ``publish_tokenizer``: `neuroshard-publish-shards`, `neuroshard-publish-tokenizer`.
- ``export``, ``generate``: `neuroshard-export` and `neuroshard-generate` over node.export and
  node.generate, with the flags that name a trained model.
- ``process``: how `neuroshard-node`, `neuroshard-verifier` and `neuroshard-adversary` end their
  process (threads joined, then out before the interpreter's teardown; faulthandler on).
- ``node_flags``: the flags of `neuroshard-node` and the typed settings they become;
  ``parser``: the argparse parser every composition root here uses.

Only these modules (and the launchers above them: neuroshard.swarm, neuroshard.adversary) know
argparse; the packages below take typed configs.
"""
