"""A differential fuzzer: a whole training job drawn from a seed, trained with and without a ``distribute=`` word on
the same backend, and compared (docs/fuzzing.md).

grammar.py draws the job (a JSON-serialisable dict), source.py writes it as a standalone Keras script, worker.py
runs a list of jobs under one or more words in one process or launch, compare.py classifies each outcome,
groups.py starts the processes of each word, long.py is ``make fuzz``.
"""
