"""One ``sgl.Engine`` in its own process (see `procs`); ``python -m
tests.engines.sglang_worker <socket>``. The engine's keyword arguments come as JSON
in PDXFER_TEST_ENGINE_ARGS; the environment (plugins, host IP, Mooncake over TCP) is
set by the test before this interpreter starts."""

from __future__ import annotations

import asyncio
import json
import os

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


def generate_each(engine, input_ids, sampling_params, **batch):
    """The batch's requests each on its own, all in flight at once: a request that
    fails answers its error (``{"error": ...}``) instead of failing the batch, as
    ``engine.generate`` does when any request is aborted."""

    async def one(i: int):
        return await engine.async_generate(input_ids=input_ids[i], sampling_params=sampling_params[i],
                                           **{k: v[i] for k, v in batch.items()})

    async def every():
        return await asyncio.gather(*(one(i) for i in range(len(input_ids))), return_exceptions=True)

    return [{"error": str(out)} if isinstance(out, Exception) else _answer(out) for out in engine.loop.run_until_complete(every())]


def _answer(out) -> dict:
    return {"output_ids": list(out["output_ids"]), "finish_reason": out["meta_info"].get("finish_reason")}


def shutdown(engine):
    if engine is not None:
        engine.shutdown()


if __name__ == "__main__":
    serve(setup, {"generate": generate, "generate_each": generate_each}, shutdown)
