"""The async API: `AsyncLLM.generate(...)` adds a request at once and returns its RequestStream, an
async iterator of incremental outputs.

One background task drives the engine: between steps it applies queued adds and aborts (so the
engine is only ever touched by one thread at a time), runs `engine.step()` in a worker thread so the
event loop keeps serving, and routes each output to the queue of the request it belongs to.
Cancelling an iteration (a client that went away) aborts the request and frees its blocks.
`between_steps(fn)` runs a read-only `fn(engine)` (a dashboard snapshot) at the next moment no step
runs, so observers never see a half-done step and never hold the loop up.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import TypeVar

from kvgen.engine.admission import AdmittedRequest
from kvgen.engine.base import Engine, Prompt
from kvgen.sampling_params import SamplingParams
from kvgen.scheduling.sequence import RequestOutput

T = TypeVar("T")


class RequestStream:
    """One request's outputs as they arrive on its queue, up to the finished one; an exception put on
    the queue is raised. The request is registered before the stream exists, so admission control
    counts it at once, not when a task first iterates it. `done(finished)` runs exactly once, however
    the stream ends: `finished` is False when it ended early (closed, cancelled, an error, or never
    iterated at all), so the request must be aborted. Shared by AsyncLLM and the data-parallel front
    end (kvgen.replicas.frontend), which feed the queue from their own engine loop and from a
    replica's connection respectively."""

    def __init__(self, queue: asyncio.Queue, done: Callable[[bool], None]) -> None:
        self._queue = queue
        self._done: Callable[[bool], None] | None = done
        self._finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._done is None:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:  # cancelled: the caller went away
            self.close()
            raise
        if isinstance(out, BaseException):
            self.close()
            raise out
        self._finished = out.finished
        if self._finished:
            self.close()
        return out

    def close(self) -> None:
        """Ends the stream; aborts the request unless it finished. Idempotent."""
        done, self._done = self._done, None
        if done is not None:
            done(self._finished)

    async def aclose(self) -> None:
        self.close()


class AsyncLLM:
    """Serves many concurrent `generate` calls from one engine loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._queues: dict[str, asyncio.Queue] = {}
        self._adds: list[tuple[str, AdmittedRequest]] = []
        self._aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stepping = False
        self._observers: list[tuple[Callable[[Engine], object], asyncio.Future]] = []

    def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Adds the request now and returns its outputs, one after every step that changed it; the
        last one is finished. Close the stream (or iterate it to the end) to release the request.

        Raises InvalidRequestError at once for a request that can never be served (the engine's
        admission checks it here, once: kvgen.engine.admission).
        """
        return self.submit(self.engine.admission.admit(prompt, params), request_id)

    def submit(self, admitted: AdmittedRequest, request_id: str | None = None) -> RequestStream:
        """`generate` for a request its caller admitted already (the server admits a job's prompts
        before it opens any stream)."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._adds.append((request_id, admitted))
        self._ensure_loop().set()

        def done(finished: bool) -> None:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

        return RequestStream(queue, done)

    def num_waiting(self) -> int:
        """Requests added but not yet in the engine, plus sequences the engine has not scheduled yet."""
        return len(self._adds) + self.engine.stats().num_waiting

    async def between_steps(self, fn: Callable[[Engine], T]) -> T:
        """`fn(engine)` run on the event loop while no step runs: at once when the engine is idle, else
        right after the running step. `fn` must only read the engine."""
        if not self._stepping:
            return fn(self.engine)
        future = asyncio.get_running_loop().create_future()
        self._observers.append((fn, future))
        return await future

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None

    def _ensure_loop(self) -> asyncio.Event:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._run())
        return self._wakeup

    async def _run(self) -> None:
        while True:
            self._apply_queued()
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            outputs = await self._step()
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    async def _step(self) -> list[RequestOutput]:
        """One engine step in a worker thread; the observers that came meanwhile run once it is over."""
        self._stepping = True
        try:
            return await asyncio.to_thread(self.engine.step)
        except asyncio.CancelledError:  # shut down mid-step: the thread may still be in it, so none runs
            cancelled, self._observers = self._observers, []
            for _, future in cancelled:
                future.cancel()
            raise
        except Exception as error:  # the engine is broken: tell every waiting caller
            self._fail_all(error)
            raise
        finally:
            self._stepping = False
            self._run_observers()

    def _run_observers(self) -> None:
        observers, self._observers = self._observers, []
        for fn, future in observers:
            if future.done():  # its caller went away
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as error:  # noqa: BLE001 - the observer's fault is its caller's to see
                future.set_exception(error)

    def _apply_queued(self) -> None:
        adds, self._adds = self._adds, []
        for request_id, admitted in adds:
            try:
                self.engine.add_admitted(request_id, admitted)
            except Exception as error:
                self._deliver(request_id, error)
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort(request_id)

    def _deliver(self, request_id: str, item: object) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _fail_all(self, error: Exception) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
