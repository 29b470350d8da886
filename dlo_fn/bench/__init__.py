"""Benchmarks: each module defines ``register(subparsers)`` for `python -m dlo_fn bench <name>`."""
