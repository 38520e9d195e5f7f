"""A worker rank's process on this machine: a fresh interpreter that never imports the parent's `__main__`.

multiprocessing's spawn re-imports the parent's main script in each child before running the target.
A plain script without an `if __name__ == "__main__":` guard then runs its `LLM(tensor_parallel_size=2)`
again inside the worker, which dies trying to start workers of its own (multiprocessing's
"bootstrapping phase" RuntimeError), while rank 0 waits out the rendezvous timeout. Fork, vLLM's
default where CUDA is not initialised, does not re-run the script, but a child forked after the
parent ran an OpenMP parallel region on more than one thread hangs at its first parallel region
(measured: the child's first torch matmul never returns; GNU libgomp keeps the parent's thread pool,
whose threads the child does not have), and kvgen loads and runs its kernels on OpenMP threads
before it starts the workers.

So a worker is `python -c BOOTSTRAP`: the bootstrap reads the parent's sys.path and then the
target's pickled arguments from its stdin, as spawn does, but imports only kvgen. The same
interpreter, the same kvgen, no user code, whatever the parent's main module is.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable

# Run by `python -c`: sys.path first (plain strings), then (target, args), pickled one after the other.
BOOTSTRAP = ("import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
             "target, args = pickle.load(sys.stdin.buffer); sys.stdin.close(); target(*args)")
MARKER = "kvgen-tensor-parallel-worker"  # in each worker's command line (tests and `ps` find workers by it)


class WorkerProcess:
    """The few things of multiprocessing.Process that rank 0 uses (pid, exitcode, join, terminate, kill),
    over subprocess.Popen. `target` must be importable by reference from kvgen (pickle)."""

    def __init__(self, target: Callable[..., None], args: tuple, env: dict[str, str], marker: str = MARKER,
                 new_session: bool = False) -> None:
        """`new_session`: out of the parent's process group, so that a terminal's ^C or a group's SIGTERM
        reaches the parent alone, which then stops the worker (data-parallel replicas)."""
        command = [sys.executable, "-c", BOOTSTRAP, marker]
        self._popen = subprocess.Popen(command, stdin=subprocess.PIPE, env=env, start_new_session=new_session)
        try:
            pickle.dump(list(sys.path), self._popen.stdin)
            pickle.dump((target, args), self._popen.stdin)
            self._popen.stdin.close()
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or -N if signal N ended it (as multiprocessing reports)."""
        return self._popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self._popen.poll() is None:
            self._popen.terminate()

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()


def worker_environment(threads: int) -> dict[str, str]:
    """This process's environment with the worker's OpenMP / OpenBLAS thread counts (read as it starts)."""
    return os.environ | {"OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
