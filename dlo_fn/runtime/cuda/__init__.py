"""Opt-in CUDA accelerators of the executor, each chosen by an :class:`~dlo_fn.runtime.options.OffloadOptions`
field and kept for a measured step-time win (``docs/performance.md``). The core runtime never imports this
package; :func:`dlo_fn.runtime.offload.offload` resolves the options into plug-ins with :func:`plugins_for`.

==================  ==================  ================================================================
option              plug-in             what it does
==================  ==================  ================================================================
``graph="block"``   :class:`BlockGraphs`  each block's compute replayed as a CUDA graph; the copies, waits
                                        and records stay the executor's eager stream operations
==================  ==================  ================================================================
"""

from __future__ import annotations

import logging
from typing import Any

from dlo_fn.runtime.cuda.block_graph import BlockGraphs

__all__ = ["BlockGraphs", "plugins_for"]

log = logging.getLogger(__name__)


def plugins_for(options: Any, platform: Any) -> BlockGraphs | None:
    """The plug-in ``options`` asks for on ``platform``, or None (eager; why is logged once when one was asked
    for and this platform cannot run it)."""
    if options.graph != "block":
        return None
    if platform.kind != "cuda":
        log.warning("cuda graph (per block): CUDA graphs need a CUDA device (platform %r); running eager",
                    platform.kind)
        return None
    return BlockGraphs(options.graph_shapes)
