"""One ``sgl.Engine`` in its own process (see `procs`); ``python -m
tests.engines.sglang_worker <socket>``. The engine's keyword arguments come as JSON
in PDXFER_TEST_ENGINE_ARGS; the environment (plugins, host IP, Mooncake over TCP) is
set by the test before this interpreter starts."""

from __future__ import annotations

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
    outputs = engine.generate(**kwargs)
    return [
        {"output_ids": list(out["output_ids"]), "finish_reason": out["meta_info"].get("finish_reason")}
        for out in outputs
    ]


def shutdown(engine):
    if engine is not None:
        engine.shutdown()


if __name__ == "__main__":
    serve(setup, {"generate": generate}, shutdown)
