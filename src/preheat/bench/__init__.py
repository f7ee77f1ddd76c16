"""Benchmarks (``preheat bench``) and the ``random:NAME`` weight folders they and every command use."""

RANDOM_PREFIX = "random:"  # here, not in random_models: a MODEL argument is told apart without its builders
