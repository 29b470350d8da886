"""DP serving over torch.distributed: requests and faults, the wire protocol, one Engine, outputs, local ranks.

==============  ==================================================================================================
module          what it owns
==============  ==================================================================================================
``requests``    submissions, engine options, per-request results, per-wave records, the report; prompts files
``batch``       one rank's R requests run block-major (``run_batch``); failing closed inside a wave; faults
``wire``        the control channel (gloo) and the status board (rendezvous store) the ranks talk through
``share``       one rank's share of a wave: run it, post progress, measure its spans
``driver``      rank 0's dispatch of formed waves: lockstep (allgather) or one queue per rank (``wave_results``:
                a wave's shares, and its outcomes matched to results)
``follower``    the other ranks' side of the protocol
``stream``      rank 0's intake of a live queue of submissions (bounded wait to fill a wave)
``continuous``  continuous serving: rank 0's ring loop and the ``cstep`` protocol (``admission``: who starts
                where at a step boundary; ``continuous_fail``: a failed step's culprits and recovery;
                ``continuous_rank``: one rank's held requests, advanced one ring step per executor run;
                ``progress``: rank 0's bar, on a terminal only)
``admission``   also admission against memory: a request that cannot fit what a rank has left is refused
                before it is queued (``memory_room``: each rank's free device and host memory, measured)
``recover``     continuous serving after a stalled or dead follower: the survivors' plan, rank-local rebuild
``engine``      ``Engine``: validation, wave formation and numbering, the stop state; uses the four above
                (``engine_parts``: the checks and wiring when an engine is built)
``outputs``     videos, previews and the JSON-lines manifests under an output folder (``writer``: each result
                written as it ends, "not completed" lines on SIGTERM, a reused folder refused or cleaned)
``local``       W spawned CPU ranks (gloo) serving phases: the demo's, the tests' and the benchmarks' way in
==============  ==================================================================================================
"""
