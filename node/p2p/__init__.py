"""The peer network of one stage: signed aiohttp protocol, DiLoCo outer rounds that agree, state sync.

Layout (one idea per file):

- ``wire``    the messages that cross the network (fixed JSON schemas, Ed25519 signatures)
- ``codec``   pseudo-gradients and replica state as safetensors bytes (fp16, blockwise int8)
- ``auth``    signed requests: client signing, the server middleware, the nonce cache
- ``peers``   the peer table: bootstrap, peer exchange, expiry, failure bans
- ``rounds``  one round's contribution book, the aggregation order, majority votes
- ``screening`` which contributions of a closed round get aggregated (validation, equivocator bans)
- ``quorum``  which peer state a replica may adopt (f + 1 signed statuses must vouch for it)
- ``state``   snapshots of θ_round and outer momentum, and adopting a peer's state
- ``server``  the aiohttp routes over a node's state
- ``exchange`` the asynchronous steps of a round (push, digests, pulls, status, state sync)
- ``network`` ``PeerNetwork``: the asyncio thread the synchronous trainer talks to; its config and flags
- ``swarm``   ``neuroshard-swarm``: N node processes on loopback
- ``byzantine`` testing only: ``neuroshard-node --attack NAME``, forged contributions on the real wire

The maths (DiLoCo, aggregation rules) stays in ``neuroshard.node``; this package only moves
tensors between replicas and calls it.
"""
