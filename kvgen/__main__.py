"""`python -m kvgen ...` (what `torchrun -m kvgen ...` runs): the same as the `kvgen` command. Under
torchrun, rank 0 runs the exit handlers (its engine's close: STOP to the other ranks, the group left)
and then ends without interpreter teardown, as the other ranks do (kvgen.distributed.worker.exit_now)."""

import atexit
import sys

from kvgen.cli import main

if __name__ == "__main__":
    status = main()
    from kvgen.distributed.group import torchrun_rank

    if torchrun_rank() is not None:
        from kvgen.distributed.worker import exit_now

        atexit._run_exitfuncs()
        exit_now(status)
    sys.exit(status)
