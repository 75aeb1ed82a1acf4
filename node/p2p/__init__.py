"""The peer plane: signed aiohttp requests between the replicas of a stage, the carriers of the
outer round, θ-hash votes and state sync, and the pipeline between stages.

Layout (one idea per file; the messages themselves are ``neuroshard.protocol``, the tensor
bodies ``neuroshard.node.codec``):

- ``plane``   ``PeerPlane``: the asyncio thread the synchronous training loop talks to, and its config
- ``auth``    signed requests over aiohttp: the client, the server middleware, the refusal → status table
- ``peers``   the peer table: bootstrap, peer exchange, expiry, failure bans
- ``rounds``  the aggregation rule type, the plurality ``HashVote`` on θ hashes, the round report
- ``quorum``  which peer state a replica may adopt (f + 1 signed statuses must vouch for it)
- ``state``   snapshots of θ_round and outer momentum, and adopting a peer's state
- ``server``  the aiohttp routes over a node's state (peers, announce, status, state)
- ``objects`` the outer round's HTTP carrier: each replica serves its round objects (GET /p2p/obj)
- ``bucket``  the outer round's S3 carrier: every replica's objects under its prefix of one bucket
- ``relay``   a replica behind NAT: its server's answers put into the stage bucket instead
- ``mailbox`` signed POSTs to a replica behind NAT through the bucket (a pipeline stage's micro-batches)
- ``exchange`` the asynchronous steps around a round: gossip, statuses, the θ-hash vote, state sync
- ``replay``  GET /p2p/replay/{round} and /p2p/segment/...: what the verifier's checks replay
- ``pipeline_wire`` the pipeline's safetensors bodies: activations forward, gradients back, in the run's codec
- ``pipeline`` next-stage routing by measured throughput, the client that retries, the forward and end routes
- ``upstream`` who feeds a stage > 0 replica and whether they all sent their signed end
- ``stages``  a replica's ``PipelineLink`` to the next stage (the stage > 0 replica: node.stage_replica)

The outer round itself (commit, scatter, reduce, gather, check, agree) is
``neuroshard.node.outer``, written against a port that ``objects`` and ``bucket`` implement. The
maths (DiLoCo, aggregation rules) stays in ``neuroshard.node``; this package only moves tensors
between replicas and calls it, and imports nothing of the loop that runs it (import-linter).
"""
