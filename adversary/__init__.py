"""Attackers, as real code outside the honest node. TESTING ONLY.

- ``attacks``: the maths of every contribution attack, fixed and adaptive (the simulator's and
  the wire's), with the screening an adaptive attacker aims under.
- ``contributions``: an `Attacker` that forges what a replica commits to, and `ForgingRound`, the
  ``OuterRound`` subclass that commits it on the real wire.
- ``owners``: owners that cheat inside the partitioned round (a wrong aggregate, two signed
  claims, a withheld part, a Δ object that does not match its root).
- ``work_lies``: trainers that misreport their work, for the verifier's replay spot checks.
- ``simulate``: M DiLoCo replicas in one process, for the convergence and robustness benchmarks.
- ``cli``: `neuroshard-adversary`, the node's own composition root with these parts plugged in;
  `neuroshard-swarm --byzantine K --attack NAME` starts it for its last K nodes.

The honest node has no hook for any of them: they subclass or replace its parts through the same
constructors an honest node is built with.
"""
