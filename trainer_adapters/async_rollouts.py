"""AsyncRollouts: an AsyncEngine plus an asyncio loop on a thread of its own, driven from a synchronous trainer
thread (async_grpo.py's rollout side). Dropped without close(), it is collected and stops its engine and thread."""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import numbers
import os
import threading
import weakref

import torch

from rollout_engine import AsyncEngine, EngineError, RequestOutput, SamplingParams
from rollout_engine.inputs import PROMPT_FORMS, one_prompt

from .async_grpo import PUSH_MODES, off_policy_step
from .sync import check_model_fits, hf_named_parameters

SETTLE_TURNS = 50  # loop turns a stopped client loop gives its tasks to end with the engine's error (a few do)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """Run the client loop until it is stopped; then let what is left on it settle (the engine is shut down by then,
    so its requests end with its EngineError within a few loop turns) and cancel the rest, so that no future
    waits forever. A function of the loop, not a method: a thread holding the AsyncRollouts would keep it from
    being collected."""
    try:
        loop.run_forever()
    finally:
        tasks = asyncio.all_tasks(loop)
        for _ in range(SETTLE_TURNS):
            if all(task.done() for task in tasks):
                break
            loop.run_until_complete(asyncio.sleep(0))
        if tasks:  # gather() of nothing would look for this thread's (absent) current loop
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()


def _stop(engine: AsyncEngine, loop: asyncio.AbstractEventLoop, thread: threading.Thread, pid: int) -> None:
    """Shut the engine down (requests in flight fail with EngineError), then stop the client loop's thread; in a
    forked child (its exit runs the finalizers too) nothing: the engine and thread are the parent's."""
    if os.getpid() != pid:
        return
    engine.shutdown()
    if not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)
    if thread is not threading.current_thread():
        thread.join(10)


async def _all_or_none(coros) -> list:
    """The coroutines' results, in order; on the first failure the others are cancelled (AsyncEngine aborts a
    cancelled caller's request, so no sample of a failed batch goes on running) and the failure is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class AsyncRollouts:
    """An AsyncEngine plus an asyncio loop on a thread, driven from a synchronous trainer thread."""

    def __init__(self, model_path, push_mode: str = "retract", **engine_kwargs):
        if push_mode not in PUSH_MODES:
            raise ValueError(f"push_mode={push_mode!r} is not allowed; one of {PUSH_MODES}")
        self.push_mode = push_mode
        self.engine = AsyncEngine(model_path, **engine_kwargs)
        # The engine version the trainer's weights are: None once a step has changed them since the last push
        self.trainer_version = self.engine.weight_version
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self._lock = threading.Lock()  # a coroutine is scheduled only on a loop that close() has not stopped
        self._thread = threading.Thread(target=_serve, args=(self.loop,), name="async-grpo-client", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self.engine, self.loop, self._thread, os.getpid())

    def run(self, coro) -> concurrent.futures.Future:
        """Schedule a coroutine on the client loop; returns a concurrent future. After close() it has already failed
        with EngineError (a stopped loop would never answer it), as AsyncEngine's calls after its shutdown do."""
        with self._lock:
            if not self._closed:
                return asyncio.run_coroutine_threadsafe(coro, self.loop)
        coro.close()  # never run: close it so that it is not reported as never awaited
        refused = concurrent.futures.Future()
        refused.set_exception(EngineError("the AsyncRollouts is closed; build a new one"))
        return refused

    def submit(self, prompts, params: SamplingParams) -> concurrent.futures.Future:
        """One AsyncEngine.generate request per prompt (a single prompt is a list of one, as Engine.generate takes
        it), all at once; the future gives the outputs in prompt order, or the first request's error, the others
        aborted (after close(): a future that has failed with EngineError, as run)."""
        if one_prompt(prompts) or isinstance(prompts, RequestOutput):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)) or inspect.isgenerator(prompts) or getattr(prompts, "ndim", 0) == 2:
            prompts = list(prompts)  # a generator, a 2-D array of ids: its rows
        if not isinstance(prompts, list) or not prompts or any(isinstance(p, numbers.Number) for p in prompts):
            raise ValueError(f"prompts must be one prompt or a non-empty list of prompts; a prompt is one of "
                             f"{PROMPT_FORMS}, or a RequestOutput to resume")

        # Made here, on the caller's thread: each call copies its prompt and params, so a trainer that edits them for
        # the next batch (a seed, max_tokens, a prompt buffer) before the loop runs this one leaves this one alone
        requests = [self.engine.generate(p, params) for p in prompts]

        async def batch():
            return await _all_or_none(requests)
        future = self.run(batch())
        # Once the batch is over, any request it never started (refused after close(), or the batch cancelled
        # first) is closed, so none is reported as never awaited; a finished one's close() does nothing
        future.add_done_callback(lambda _: [request.close() for request in requests])
        return future

    def step(self, model, optimizer, outputs, rewards, group_size: int, pad_id: int, **kwargs) -> dict:
        """off_policy_step against the weights the trainer holds and with this rollouts' push mode. A second step
        before push_weights (PPO epochs on one batch) finds the trainer's weights moved past every version, so
        every token is off-policy: its ratio is taken against the engine's logprob and clipped."""
        stats = off_policy_step(model, optimizer, outputs, rewards, group_size, pad_id, self.trainer_version,
                                mode=self.push_mode, **kwargs)
        self.trainer_version = None
        return stats

    def push_weights(self, model) -> int:
        """Copy the model's weights into the engine between two steps (requests in flight paused with
        `push_mode`, then continued: the continue lifts any pause in force, one of the caller's own on
        `self.engine` included); blocks the caller until done. Returns the new version. A model the engine
        cannot take (check_model_fits) is refused before anything pauses: a name it lacks, found after the first
        tensors were copied, would leave its requests waiting for a complete set. After close(): EngineError."""
        if not self._closed:
            check_model_fits(self.engine.engine, model)

        async def push():
            await self.engine.pause_generation(self.push_mode)
            try:
                with torch.no_grad():
                    return await self.engine.update_weights(hf_named_parameters(model))  # one tensor at a time
            finally:
                await self.engine.continue_generation()
        self.trainer_version = self.run(push()).result()
        return self.trainer_version

    def close(self) -> None:
        """Shut the engine down (requests in flight fail with EngineError) and stop the client loop; later calls
        are refused with EngineError. A second close() does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()

    def __enter__(self) -> "AsyncRollouts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
