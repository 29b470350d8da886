import logging
import os
import sys

from dlo_fn.cli import main

if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank leaves without the interpreter's teardown, its outputs written and its process group
        # destroyed: what is left is destructors, and gloo's threads torn down at exit aborted a follower on a
        # loaded 2-core machine ("terminate called without an active exception", exit -6) after every request had
        # its answer (seen in a fresh clone's make test); dlo_fn.serve.local leaves its ranks the same way.
        logging.shutdown()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
