"""dlo_fn: Distributed Layerwise Offload for diffusion transformers.

============  =====================================================================================
package       job
============  =====================================================================================
``plan``      pure planners on frozen data: specs, layouts, schedules and rings, timelines, memory
              models, waves and dispatch (no device, stream, process group or file I/O)
``models``    the reference video DiT (with Ulysses SP), sampler, requests, checkpoint writer
``runtime``   one rank running a plan: loading, host store, executor, mesh (the only device state)
``serve``     DP serving over torch.distributed: requests, faults, wire, the Engine, outputs
``repro``     the published numbers, the constants fitted to them, the models that explain them, and
              every table the notebooks print
``figures``   one drawing function per figure
``cli``       ``python -m dlo_fn ...``; ``bench``: benchmarks that write ``figures/data/``
============  =====================================================================================

Imports go one way (``tests/test_layering.py``): plan <- models <- runtime <- serve <- cli, and repro /
figures read plan (and committed data) only.
"""

__version__ = "0.1.0"
