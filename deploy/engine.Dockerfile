# An engine image that serves with pdxfer: the engine's own image (SGLang's or vLLM's) with
# pdxfer installed from this checkout. SGLang loads pdxfer's backend, and vLLM its connector,
# inside the engine's processes (through the entry points sglang.srt.plugins and
# vllm.general_plugins), so pdxfer must be in the engine's own Python; the daemon runs in its
# own container (deploy/Dockerfile) and the engine needs no transfer engine.
#
# Build from the repository root, naming the engine's image (a version the adapters support:
# SGLang 0.5.23; vLLM 0.32 or 0.33):
#   docker build -f deploy/engine.Dockerfile --build-arg ENGINE_IMAGE=lmsysorg/sglang:v0.5.23 \
#     --build-arg PACKAGES=sglang-router -t pdxfer-sglang:0.5.23 .
#   docker build -f deploy/engine.Dockerfile --build-arg ENGINE_IMAGE=vllm/vllm-openai:v0.33.0 \
#     -t pdxfer-vllm:0.33.0 .
# PACKAGES: more to install beside pdxfer (sglang-router, for the router Deployment of
# k8s/overlays/sglang, which runs this image too).
#
# The image runs as UID 1000, as the pdxfer daemon beside it does (the daemon's socket and the
# engine's pools are owner-only: deploy/README.md, "Which user"), with HOME in /tmp and the
# model cache (HF_HOME) at /models, where the manifests mount a volume.

ARG ENGINE_IMAGE
FROM ${ENGINE_IMAGE}
ARG PACKAGES=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /opt/pdxfer/src/
COPY pdxfer/ /opt/pdxfer/src/pdxfer/
# pdxfer's own dependencies (msgspec, pyzmq, numpy, ...) only where the engine lacks them:
# pip keeps the engine's versions of those it has. No extras: the entry points come with
# pdxfer itself, and the engine brings torch and, for pdxfer proxy, aiohttp.
RUN set -eu; \
    python3 -m pip install /opt/pdxfer/src $PACKAGES; \
    python3 -c "from importlib.metadata import entry_points as found; missing = [g for g in ('sglang.srt.plugins', 'vllm.general_plugins') if 'pdxfer' not in {e.name for e in found(group=g)}]; assert not missing, missing"; \
    getent passwd 1000 >/dev/null || useradd --uid 1000 --user-group --no-create-home --home-dir /tmp pdxfer; \
    mkdir -p /models && chown 1000:1000 /models
ENV HOME=/tmp HF_HOME=/models
USER 1000:1000
