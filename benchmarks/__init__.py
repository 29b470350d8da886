"""The lab beside the library: benchmarks (``bench``), the published-number reproduction and every table the
notebooks print and the docs render (``repro``), and the figure drawing (``figures``). It imports :mod:`dlo_fn`;
nothing in :mod:`dlo_fn` imports it. ``python -m benchmarks --help`` lists its commands."""
