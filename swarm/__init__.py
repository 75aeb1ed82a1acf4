"""`neuroshard-swarm`: a local swarm of node processes on loopback, for the demo, benchmarks and tests.

- ``cli``: the launcher: N `neuroshard-node` processes (and `neuroshard-adversary` for the last
  K with --byzantine), their tokens, ports and peers, their output, and per-round θ-hash agreement.
- ``verifier``: the one `neuroshard-verifier` process the swarm's nodes join, defined from the
  nodes' own flags.

A launcher: it sits above every other package and nothing imports it.
"""
