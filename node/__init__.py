"""The honest node: everything one replica does, below its command line (neuroshard.cli.node).

- the model and its maths: ``model`` (Llama-style presets, stages), ``diloco`` (the inner and
  outer optimizers, pseudo-gradients, the weight hash), ``aggregation`` and ``validation`` (robust
  rules and the screening in front of them), ``actcodec`` (the pipeline's activation codec),
  ``vocab`` (vocabulary growth), ``device`` (where the inner loop runs and in what precision);
- the loop: ``inner_loop`` (the one loop every replica runs), ``trainer`` (stage 0: its own
  shards), ``stage_worker`` and ``stage_replica`` (stage > 0: the micro-batches that arrive),
  ``pipeline`` (a step across stages), ``rotation``, ``checkpoint``, ``work``;
- the peer plane: ``p2p`` (signed HTTP between replicas, the carriers of the round) and ``outer``
  (the partitioned outer round);
- reporting to the verifier: ``reporting``, ``tracker`` (the node's client of the verifier),
  ``receipt`` (a round's signed work report), ``replay`` and ``segments``/``segment_store`` (what
  the verifier's replay and segment checks need), ``membership``/``roster`` (who takes part);
- identity and the run: ``wallet`` (the token's key), ``network_definition`` (the run's signed
  definition), ``embedded`` (the default data set of the one-command run);
- using the trained model: ``export`` (a Hugging Face folder), ``generate``, ``model_file``.

It imports data and tokenizer, never the verifier, the API or the launchers above it
(import-linter contracts in pyproject.toml).
"""
