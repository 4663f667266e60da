"""Real-engine tests: SGLang and vLLM on CPU, in the environment `make engines-env`
builds (.venv-engines). They skip where the engines are not importable, except under
`make test-engines` (REQUIRE_ENGINE_TESTS=1), where a missing engine is an error."""
