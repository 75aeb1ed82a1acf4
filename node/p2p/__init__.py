"""The peer network: signed aiohttp protocol, DiLoCo outer rounds that agree per stage, state sync,
and the pipeline between stages.

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
- ``swarm``   ``neuroshard-swarm``: N node processes on loopback (``--stages S``: node i holds stage i mod S)
- ``pipeline_wire`` the pipeline's messages: activations forward, gradients back (signed headers, safetensors)
- ``pipeline`` next-stage routing by measured throughput, the client that retries, the forward route
- ``stages``  ``--stages/--stage`` wiring: the driver's link to stage 1, a whole stage > 0 replica
- ``byzantine`` testing only: ``neuroshard-node --attack NAME``, forged contributions on the real wire

The maths (DiLoCo, aggregation rules) stays in ``neuroshard.node``; this package only moves
tensors between replicas and calls it.
"""
