"""Opt-in CUDA accelerators of the executor, each chosen by an :class:`~dlo_fn.runtime.options.OffloadOptions`
field and kept for a measured step-time win (``docs/performance.md``). The core runtime never imports this
package; :func:`dlo_fn.runtime.offload.offload` resolves the options into plug-ins with :func:`plugins_for`.

====================  ====================  ==============================================================
option                plug-in               what it does
====================  ====================  ==============================================================
``graph="block"``     :class:`BlockGraphs`  each block's compute replayed as a CUDA graph; the copies, waits
                                            and records stay the executor's eager stream operations
``dequant="kernel"``  ``KernelDequant``     FP8 shards' dequantise op as one Triton launch per block
                                            (``"auto"``: where CUDA and Triton are there)
``host_fill=``        ``ParallelFill``      the host arena filled in 2 MiB pages on several threads and
``"parallel"``                              registered range by range during the copy (``"auto"``: on CUDA)
====================  ====================  ==============================================================
"""

from __future__ import annotations

import logging
from typing import Any

from dlo_fn.runtime.cuda.block_graph import BlockGraphs

__all__ = ["BlockGraphs", "plugins_for", "dequantizer_for"]

log = logging.getLogger(__name__)


def plugins_for(options: Any, platform: Any) -> BlockGraphs | None:
    """The plug-in ``options`` asks for on ``platform``, or None (eager; why is logged once when one was asked
    for and this platform cannot run it)."""
    if options.graph != "block":
        return None
    if platform.kind != "cuda":
        log.warning(
            "cuda graph (per block): CUDA graphs need a CUDA device (platform %r); running eager", platform.kind
        )
        return None
    return BlockGraphs(options.graph_shapes)


def dequantizer_for(options: Any, platform: Any) -> Any:
    """The DQ op's plug-in ``options`` asks for on ``platform`` (:mod:`dlo_fn.runtime.cuda.dequant`), or None
    (the core's torch ops)."""
    if options.quantization is None or options.dequant == "torch":
        return None
    why = "needs a CUDA device" if platform.kind != "cuda" else None
    if why is None:
        try:
            from dlo_fn.runtime.cuda.dequant import KernelDequant
        except ImportError as exc:
            why = f"needs Triton ({exc})"
    if why is not None:
        if options.dequant == "kernel":
            raise ValueError(f"dequant='kernel' {why}: use dequant='torch' (or 'auto')")
        return None
    return KernelDequant()
