"""The peer network: signed aiohttp protocol, the carriers of the outer round, θ-hash votes and
state sync per stage, and the pipeline between stages.

Layout (one idea per file; the messages themselves are ``neuroshard.protocol``):

- ``codec``   pseudo-gradients and replica state as safetensors bytes (fp16, blockwise int8)
- ``auth``    signed requests over aiohttp: the client, the server middleware, the refusal → status table
- ``peers``   the peer table: bootstrap, peer exchange, expiry, failure bans
- ``rounds``  the aggregation rule type, the plurality vote on θ hashes, the round report
- ``quorum``  which peer state a replica may adopt (f + 1 signed statuses must vouch for it)
- ``state``   snapshots of θ_round and outer momentum, and adopting a peer's state
- ``server``  the aiohttp routes over a node's state (peers, announce, status, state)
- ``objects`` the outer round's HTTP carrier: each replica serves its round objects (GET /p2p/obj)
- ``bucket``  the outer round's S3 carrier: every replica's objects under its prefix of one bucket
- ``exchange`` the asynchronous steps around a round: gossip, statuses, the θ-hash vote, state sync
- ``network`` ``PeerNetwork``: the asyncio thread the synchronous trainer talks to; its config and flags
- ``replay``  GET /p2p/replay/{round}: what the verifier needs to replay one of a replica's rounds
- ``swarm``   ``neuroshard-swarm``: N node processes on loopback (``--stages S``: node i holds stage i mod S)
- ``swarm_verifier`` the swarm's verifier process, which every node of the swarm joins
- ``pipeline_wire`` the pipeline's safetensors bodies: activations forward, gradients back, in the run's codec
- ``pipeline`` next-stage routing by measured throughput, the client that retries, the forward route
- ``stages``  ``--stages/--stage`` wiring: the driver's link to stage 1, a whole stage > 0 replica
- ``byzantine`` testing only: ``neuroshard-node --attack NAME``, forged round inputs on the real wire

The outer round itself (commit, scatter, reduce, gather, check, agree) is
``neuroshard.node.outer``, written against a port that ``objects`` and ``bucket`` implement. The
maths (DiLoCo, aggregation rules) stays in ``neuroshard.node``; this package only moves tensors
between replicas and calls it.
"""
