"""One ``sgl.Engine`` in its own process (see `procs`); ``python -m
tests.engines.sglang_worker <socket>``. The engine's keyword arguments come as JSON
in PDXFER_TEST_ENGINE_ARGS; the environment (plugins, host IP, Mooncake over TCP) is
set by the test before this interpreter starts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from tests.engines.procs import serve

ENGINE_ARGS_ENV = "PDXFER_TEST_ENGINE_ARGS"


def setup():
    import sglang as sgl

    kwargs = json.loads(os.environ[ENGINE_ARGS_ENV])
    engine = sgl.Engine(**kwargs)
    return engine, {"pid": os.getpid(), "sglang": sgl.__version__}


def generate(engine, **kwargs):
    """``engine.generate`` on a batch; per request, the generated ids and the
    finish reason."""
    return [_answer(out) for out in engine.generate(**kwargs)]


def generate_each(engine, input_ids, sampling_params, abort: dict | None = None, **batch):
    """The batch's requests each on its own, all in flight at once: a request that
    fails answers its error (``{"error": ...}``) instead of failing the batch, as
    ``engine.generate`` does when any request is aborted.

    ``abort`` ({"index": i, "admin": endpoint, "state": s}) aborts request i, as a
    client that goes away does, once the pdxfer daemon at admin endpoint ``admin``
    reports its room in state ``s``; its answer then carries ``aborted_at``, the room
    as that daemon reported it. With ``"pause": {"pid": p, "seconds": t}`` process p
    (a daemon) is stopped (SIGSTOP) just before the abort and resumed t seconds later:
    a peer slow to answer; ``aborted_at["resumed"]`` is then when (wall clock)."""
    rids = [f"room-{room}" for room in batch["bootstrap_room"]] if "bootstrap_room" in batch else [None] * len(input_ids)
    seen = {}

    async def one(i: int):
        return await engine.async_generate(input_ids=input_ids[i], sampling_params=sampling_params[i], rid=rids[i],
                                           **{k: v[i] for k, v in batch.items()})

    async def every():
        watch = [_abort_when(engine, rids[abort["index"]], batch["bootstrap_room"][abort["index"]], abort, seen)] if abort else []
        return await asyncio.gather(*(one(i) for i in range(len(input_ids))), *watch, return_exceptions=True)

    outs = engine.loop.run_until_complete(every())
    if abort and isinstance(outs[-1], Exception):
        raise outs[-1]
    outs = outs[: len(input_ids)]
    answers = [{"error": str(out)} if isinstance(out, Exception) else _answer(out) for out in outs]
    if abort:
        answers[abort["index"]]["aborted_at"] = seen.get("room")
    return answers


async def _abort_when(engine, rid: str, room: int, abort: dict, seen: dict, timeout: float = 120.0) -> None:
    """Abort ``rid`` once the daemon at ``abort["admin"]`` reports ``room`` in ``abort["state"]``."""
    import msgspec

    from pdxfer.core.protocol import AdminRooms
    from pdxfer.ops.inspection import AdminClient

    deadline = time.monotonic() + timeout
    with AdminClient(abort["admin"]) as admin:
        while time.monotonic() < deadline:
            reply = await asyncio.to_thread(admin.call, AdminRooms)
            found = [r for r in reply.rooms if r.room == room and r.state.value == abort["state"]]
            if found:
                seen["room"] = msgspec.to_builtins(found[0])
                pause = abort.get("pause")
                if pause:
                    os.kill(pause["pid"], signal.SIGSTOP)
                try:
                    engine.tokenizer_manager.abort_request(rid)
                    if pause:
                        await asyncio.sleep(pause["seconds"])
                finally:
                    if pause:
                        os.kill(pause["pid"], signal.SIGCONT)
                        seen["room"]["resumed"] = time.time()
                return
            await asyncio.sleep(0.001)
    raise TimeoutError(f"room {room} never reached {abort['state']} in {timeout:.0f} s")


def _answer(out) -> dict:
    return {"output_ids": list(out["output_ids"]), "finish_reason": out["meta_info"].get("finish_reason")}


def shutdown(engine):
    if engine is not None:
        engine.shutdown()


if __name__ == "__main__":
    serve(setup, {"generate": generate, "generate_each": generate_each}, shutdown)
