"""Benchmarks: each module defines ``register(subparsers)`` for `python -m benchmarks bench <name>`."""
