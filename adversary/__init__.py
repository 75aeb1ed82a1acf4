"""Attackers of the partitioned round, as real code outside the honest node.

Each class here subclasses the honest ``neuroshard.node.outer.round.OuterRound`` and overrides
one step to cheat the way an adversary who knows the protocol would. The simulator
(``bench/sim_partitioned.py``) and the tests run them over the same carriers as honest replicas;
the honest node has no hook for them.
"""
