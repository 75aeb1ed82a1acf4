"""The partitioned outer round: how the replicas of a stage turn their Δs into one aggregate.

- ``round``: `OuterRound`, one replica's round in named phases (commit, scatter, reduce, gather,
  check), over a `RoundStore` port;
- ``port``: the carrier interface (HTTP peers, an S3 bucket, memory) and its routing;
- ``partition``: which member owns which part of the flat vector;
- ``reduce``: per-part screening and robust reduction, and the part encodings;
- ``messages``: the signed commitments, claims and echoes a round exchanges.
"""
