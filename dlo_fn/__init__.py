"""dlo_fn: Distributed Layerwise Offload for diffusion transformers.

Pure planners live in :mod:`dlo_fn.plan` (frozen data, no device, stream, process group or file I/O);
the only state lives in :mod:`dlo_fn.runtime`. The dependency rule is one-way: runtime -> plan.
"""

__version__ = "0.1.0"
