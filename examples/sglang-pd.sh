#!/usr/bin/env bash
# SGLang prefill/decode with pdxfer on one CPU host: a daemon and a server of each role, SGLang's
# router, one request. From pdxfer's checkout, in an environment with SGLang, sglang-router and
# pdxfer (. .venv-engines/bin/activate). Across hosts, each daemon and server takes its host's --host.
set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT
up() { for _ in $(seq 600); do curl -sf -o /dev/null "$1" && return; sleep 1; done; echo "$1: no answer" >&2; return 1; }

MODEL=${MODEL:-/tmp/pdxfer-tiny-llama}
python -m tests.engines.model "$MODEL"   # a 2-layer Llama, random weights, no tokenizer: prompts are token ids

# CPU: no CUDA kernels or events; no tokenizer; a KV pool of 16,384 tokens (pdxfer moves it
# into /dev/shm); idle schedulers sleep, as two servers share the cores.
CPU="--device cpu --attention-backend torch_native --dtype float32 --page-size 16 --max-total-tokens 16384
     --disable-overlap-schedule --sleep-on-idle --skip-tokenizer-init"

pdxfer serve --role prefill --bootstrap-port 18998 --bootstrap-timeout 300 --http-port 9100 &
pdxfer serve --role decode --http-port 9101 &
up http://127.0.0.1:9100/healthz; up http://127.0.0.1:9101/healthz

python -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port 30000 $CPU \
    --disaggregation-mode prefill --disaggregation-transfer-backend pdxfer --disaggregation-bootstrap-port 8998 &
python -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port 30001 $CPU \
    --disaggregation-mode decode --disaggregation-transfer-backend pdxfer \
    --disaggregation-decode-retraction-backup cpu_tensor &   # SGLang's default backup pins memory with CUDA
up http://127.0.0.1:30000/health; up http://127.0.0.1:30001/health

python -m sglang_router.launch_router --pd-disaggregation --host 127.0.0.1 --port 8000 \
    --prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001 &
up http://127.0.0.1:8000/readiness

# The router picks a room and sends the request to both servers; the decode answers the tokens.
curl -s http://127.0.0.1:8000/generate -H 'Content-Type: application/json' \
    -d '{"input_ids": [247, 825, 993, 148, 825], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}'
echo
curl -s http://127.0.0.1:9101/metrics | grep '^pdxfer_room_transitions_total{state="success"}'   # the room, on the decode daemon
