"""Checkpoints to modules, and host memory as the kernel sees it: below the runtime, above the plan.

A checkpoint (a dlo_fn folder, a safetensors file or index, a diffusers folder or cached repo) is resolved and its
headers read strictly (``checkpoint``), a model is built on the meta device and every stored tensor bound to a
zero-copy view of the file's mapping (``load``, ``bind``, ``diffusers_load``: diffusers classes as
``from_pretrained`` builds them), a spec comes from a name or a checkpoint (``sources``), the mapping is let go once
the host store holds its copies (``release``), and process and cgroup memory are read from ``/proc`` and the cgroup
files (``memstat``). The runtime (:mod:`dlo_fn.runtime`) takes the bound module from here; nothing here touches a
device stream or a process group.
"""
