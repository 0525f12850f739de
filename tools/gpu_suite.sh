#!/usr/bin/env bash
# Kipp's GPU suites on a machine with one NVIDIA GPU (two for `tp`), from the repository root:
#   bash tools/gpu_suite.sh env|tests|decode|prefill|throughput|tp|kernels|mlx|mlxtests|mlxbench|mlxprofile|serve|vllm|long|llama|all
#   env         the GPU, driver and library versions and the commit ($OUT/env.txt)
#   tests       the GPU tests: tests/cuda (-k gpu) and the conformance gates on the cuda backend
#   decode      BENCHMARKS.md's H200 commands: 0.6B batch-1 decode and prefill, 256-request
#               throughput and the repeated prompt (transformers in the same run), then 8B
#               batch-1 decode in bf16, q8_0 and affine4 at a 2,048-token prompt
#   prefill     8B bf16 2,048-token prefill with transformers in the same run, 8B 16,384 tokens,
#               0.6B 2,048 tokens (median of 5)
#   throughput  0.6B offline throughput over 256 requests, three times (it moves with the host)
#   tp          (2 GPUs) the 8B TP=2 gate against TP=1, 8B decode at TP=1 and TP=2, 32B at TP=2
#   kernels     every custom kernel against its reference and the device's ceilings
#   mlx         (MLX's CUDA build importable: `import mlx.core` sees the GPU) the MLX GPU tests
#               with kernels required, then the MLX backend against mlx-lm in the same runs:
#               0.6B and 8B, bf16 and affine4, batch-1 prefill of 2,048 and decode after 2,048
#               and 128 tokens; 8B bf16 64 x 128; 0.6B 256-request throughput
#   serve       0.6B `kipp serve` (defaults) under 256 concurrent streams of kipp bench serve, a
#               Poisson sweep at 10, 20 and 40 requests/s, then offline LLM.generate on the same
#               workload at kipp serve's KV budget
#   vllm        `vllm serve` (VLLM_SITE: its unpacked tree) under serve's load
#   serve and vllm take a shape (0.6b, 8b); N and C set the requests and the concurrent streams
#   long        (a backend: cuda, the default, or mlx) 8B bf16 batch-1 prefill and decode at
#               contexts of 2,048, 32,768 and 131,072 tokens (YaRN past 40,960), with bf16 and
#               q8_0 KV caches (KV="q8_0": one of them), then the 4B-2507 shape's batch-1 decode and 2,048-token
#               prefill beside 0.6B
#   llama       llama.cpp (built from .peers/llama.cpp-src.tar.xz on first use) on the long suite's
#               8B checkpoint with static YaRN in its GGUF: prefill of 2,048 / 32,768 / 131,072
#               tokens and decode at depths 0 / 32,768 / 131,072 (llama-bench)
#   mlxtests    the MLX GPU tests alone (kernels required), the first half of `mlx`
#   mlxbench    one of `mlx`'s rows: SHAPE QUANT PROMPT BATCHES [more kipp bench arguments]
#   mlxprofile  the paged decode attention alone (tools/profile/mlx_attention_bench.py), then
#               the MLX decode step against mlx-lm kernel by kernel (0.6B and 8B bf16 after
#               2,048 tokens, tools/profile/mlx_decode_profile.py), then Kipp's step with the
#               paged attention's reference (gather + SDPA), eager, and at MLX_MAX_OPS_PER_BUFFER
#               of 250 ($OUT/mlx_profile.jsonl)
#   all         env, tests, decode, prefill, throughput (and tp where two GPUs are visible)
# Each benchmark writes $OUT/<name>.json (and .md where it has a table); OUT defaults to /tmp/out.
# A fallback to a reference path is fatal (KIPP_CUDA_REQUIRE_KERNELS=1), so no figure comes from one.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1
export KIPP_HOME=${KIPP_HOME:-/tmp/kipp} KIPP_CUDA_REQUIRE_KERNELS=1
# NVLink multicast off: the fused TP=2 all-reduce and NCCL then take the plain peer path
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

step() { echo "== $(date +%T) $*"; }
bench() { python -m kipp_core.cli.main bench "$@"; }
gpus() { python -c "import torch; print(torch.cuda.device_count())"; }

env_info() {  # also kept in $OUT/env.txt: the record's hardware, versions and commit
  step env
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python -c "import torch, triton, transformers, numpy
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers',
      transformers.__version__, 'numpy', numpy.__version__)"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    git status --short 2>/dev/null | head -20
  } 2>&1 | tee "$OUT/env.txt"
}

tests() {
  step "GPU tests: tests/cuda -k gpu"
  python -m pytest -q -p no:cacheprovider -n 4 --timeout 300 -k gpu tests/cuda 2>&1 \
    | tee "$OUT/tests_cuda.log" | tail -15
  step "conformance gates on the cuda backend"
  python -m pytest -q -p no:cacheprovider -n 4 --timeout 300 tests/conformance -k cuda 2>&1 \
    | tee "$OUT/tests_conformance.log" | tail -6
}

decode8() {  # 8B batch-1 decode in bf16, q8_0 and affine4 (records $OUT/b8_<quant>.json)
  for q in none q8_0 affine4; do
    step "8B $q, batch 1, 2,048-token prompt"
    qa=""; [ "$q" != none ] && qa="--quant $q"
    bench --random-weights qwen3-8b --backend cuda $qa --batch-sizes 1 --prompt-len 2048 \
      --gen-len 128 --kv-cache-memory 16GiB --json "$OUT/b8_$q.json" 2>&1 | grep -E "ready|\| kipp"
  done
}

decode() {
  step "0.6B: batch-1 decode and prefill, throughput, repeated prompt (transformers peer)"
  bench --random-weights qwen3-0.6b --backend cuda --batch-sizes 1 --prompt-len 2048 \
    --gen-len 256 --num-requests 256 --min-len 100 --max-len 1024 --prefix-len 6890 \
    --kv-cache-memory 48GiB --peers transformers --json "$OUT/b06.json" --markdown "$OUT/b06.md" \
    2>&1 | grep -E "\| (kipp|trans)|hroughput|refix"
  decode8
}

prefill() {
  step "8B bf16, 2,048-token prefill (transformers peer)"
  bench --random-weights qwen3-8b --backend cuda --batch-sizes 1 --prompt-len 2048 --gen-len 8 \
    --kv-cache-memory 16GiB --peers transformers --json "$OUT/p8_2k.json" \
    --markdown "$OUT/p8_2k.md" 2>&1 | grep -E "\| (kipp|trans)"
  step "8B bf16, 16,384-token prefill"
  bench --random-weights qwen3-8b --backend cuda --batch-sizes 1 --prompt-len 16384 --gen-len 4 \
    --kv-cache-memory 24GiB --json "$OUT/b8_16k.json" 2>&1 | grep -E "\| kipp"
  step "0.6B bf16, 2,048-token prefill, median of 5"
  bench --random-weights qwen3-0.6b --backend cuda --batch-sizes 1 --prompt-len 2048 --gen-len 8 \
    --repeats 5 --kv-cache-memory 16GiB --json "$OUT/p06_2k.json" 2>&1 | grep -E "\| kipp"
}

throughput() {
  for i in 1 2 3; do
    step "0.6B offline throughput, 256 requests ($i of 3)"
    bench --random-weights qwen3-0.6b --backend cuda --batch-sizes 1 --prompt-len 16 --gen-len 8 \
      --num-requests 256 --min-len 100 --max-len 1024 --kv-cache-memory 48GiB \
      --json "$OUT/tput06_$i.json" 2>&1 | grep -E "hroughput"
  done
}

tp() {
  if [ "$(gpus)" -lt 2 ]; then echo "tp: needs 2 GPUs, $(gpus) visible"; return 1; fi
  nvidia-smi topo -m
  step "8B TP=2 gate: logits and greedy tokens against TP=1"
  python tools/gates/tp_gate.py --shape qwen3-8b 2>&1 | tee "$OUT/tp_gate.log" | tail -4
  for t in 1 2; do
    step "8B bf16 decode, TP=$t"
    bench --random-weights qwen3-8b --backend cuda --tensor-parallel $t --batch-sizes 1 \
      --prompt-len 512 --gen-len 128 --kv-cache-memory 16GiB --max-model-len 8192 \
      --json "$OUT/b8_tp$t.json" 2>&1 | grep -E "ready|\| kipp"
  done
  step "32B bf16 decode, TP=2"
  bench --random-weights qwen3-32b --backend cuda --tensor-parallel 2 --batch-sizes 1 \
    --prompt-len 512 --gen-len 128 --kv-cache-memory 16GiB --max-model-len 8192 \
    --json "$OUT/b32_tp2.json" 2>&1 | grep -E "ready|\| kipp"
}

kernels() {
  step "kernels against their references and the device's ceilings"
  python -m kipp_cuda.kernels.bench 2>&1 | tee "$OUT/kernels.md" | tail -60
}

mlx_bench() {  # $1 shape, $2 quant (none|affine4), $3 prompt length, $4 batch sizes, rest: more
  local qa=""; [ "$2" != none ] && qa="--quant $2"
  step "MLX $1 $2: batch $4, prompt $3 (mlx-lm in the same run)"
  KIPP_MLX_REQUIRE_KERNELS=1 bench --random-weights "qwen3-$1" --backend mlx $qa --batch-sizes "$4" \
    --prompt-len "$3" --gen-len 128 --peers mlx-lm --repeats 2 "${@:5}" \
    --json "$OUT/mlx_$1_$2_$3_b$4.json" --markdown "$OUT/mlx_$1_$2_$3_b$4.md" 2>&1 \
    | grep -E "^\| (kipp|mlx-lm)|hroughput|error" | cut -c1-160
}

mlx_gpu() {
  python -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, 'MLX runs on the CPU'"
}

mlxtests() {
  mlx_gpu || return 1
  step "MLX GPU tests, kernels required"
  KIPP_MLX_REQUIRE_KERNELS=1 python -m pytest -q -p no:cacheprovider -n 12 --timeout 300 \
    tests/mlx/test_kernels_gpu.py tests/mlx/test_gpu_gates.py tests/mlx/test_decode_graph.py \
    2>&1 | tee "$OUT/tests_mlx.log" | tail -6
}

long() {  # $1 backend (cuda or mlx); KV: the KV caches to run (default "bf16 q8_0")
  local be=${1:-cuda} kv
  [ "$be" = mlx ] && { mlx_gpu || return 1; export KIPP_MLX_REQUIRE_KERNELS=1; }
  # bf16 KV bounds decode at 131,072 tokens to 45% of its 2,048-token rate (19.3 GB of KV a token
  # beside 15.1 GB of weights); q8_0 KV reads 0.53 as many bytes
  for kv in ${KV:-bf16 q8_0}; do
    local ka="" tag=""
    [ "$kv" != bf16 ] && { ka="--kv-quant $kv"; tag="_kv$kv"; }
    step "$be 8B bf16, $kv KV, batch 1, contexts 2,048 / 32,768 / 131,072 (YaRN past 40,960)"
    bench --random-weights qwen3-8b --backend "$be" --batch-sizes 1 --max-model-len 131072 \
      --context-lens 2048,32768,131072 --gen-len 64 --max-num-batched-tokens 16384 $ka \
      --kv-cache-memory 24GiB --json "$OUT/long8_$be$tag.json" --markdown "$OUT/long8_$be$tag.md" \
      2>&1 | grep -E "^\| kipp|error" | cut -c1-160
  done
  for shape in qwen3-4b-instruct-2507 qwen3-0.6b; do
    step "$be $shape bf16, batch 1, 2,048-token prompt"
    bench --random-weights $shape --backend "$be" --batch-sizes 1 --prompt-len 2048 --gen-len 128 \
      --kv-cache-memory 16GiB --max-model-len 32768 --json "$OUT/b_${shape}_$be.json" 2>&1 \
      | grep -E "^\| kipp|error"
  done
}

mlxprofile() {
  mlx_gpu || return 1
  step "MLX paged decode attention against cuDNN's SDPA, chained and at every split count"
  python tools/profile/mlx_attention_bench.py --chained --splits --json "$OUT/mlx_attn.jsonl"
  local p="python tools/profile/mlx_decode_profile.py --json $OUT/mlx_profile.jsonl"
  for shape in qwen3-0.6b qwen3-8b; do
    step "MLX $shape decode after 2,048 tokens, kernel by kernel, mlx-lm beside"
    $p --shape $shape --kernels | cut -c1-300
    step "MLX $shape: the attention reference, the eager step, 250 ops a CUDA graph"
    KIPP_MLX_DISABLE_KERNELS=decode_attention $p --shape $shape --engines kipp --kernels \
      | cut -c1-300
    KIPP_MLX_COMPILE=0 $p --shape $shape --engines kipp | cut -c1-300
    MLX_MAX_OPS_PER_BUFFER=250 $p --shape $shape | cut -c1-300
  done
}

mlx() {
  mlxtests || return 1
  mlx_bench 8b affine4 2048 1
  mlx_bench 8b none 2048 1
  mlx_bench 0.6b none 2048 1
  mlx_bench 0.6b affine4 2048 1
  mlx_bench 0.6b none 128 1
  mlx_bench 8b affine4 128 1
  mlx_bench 8b none 128 64 --kv-cache-memory 16GiB
  mlx_bench 0.6b none 16 1 --num-requests 256 --min-len 100 --max-len 1024 \
    --kv-cache-memory 48GiB
}

ckpt() {  # the path of a registry shape's random-weight checkpoint (made on first use)
  python -c "from kipp_core.tiny import random_checkpoint; print(random_checkpoint('$1'))" | tail -1
}

wait_up() {  # $1 URL, $2 seconds, $3 the server's pid: until /v1/models answers or the server dies
  for _ in $(seq 1 "$2"); do
    curl -sf "$1/v1/models" > /dev/null && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

load() {  # $1 URL, $2 name, rest: more kipp bench serve arguments (N and C: requests, streams)
  python -m kipp_core.cli.main bench serve --url "$1" --model m --num-requests "${N:-256}" \
    --concurrency "${C:-256}" --min-len 100 --max-len 1024 --client-procs 4 --no-progress \
    --json "$OUT/$2.json" --markdown "$OUT/$2.md" "${@:3}" 2>&1 | grep -E "^\| (conc|rate|load)" \
    | cut -c1-150
}

serve() {  # $1 shape (default 0.6b): kipp serve with its defaults, then offline at its KV budget
  local shape=${1:-0.6b} ck port=8123 tag
  tag=$(echo "$shape" | tr -d .)
  ck=$(ckpt "qwen3-$shape")
  step "kipp serve $shape, defaults, ${N:-256} requests at ${C:-256} streams"
  python -m kipp_core.cli.main serve --model "$ck" --backend cuda --port $port \
    --served-model-name m --no-access-log > "$OUT/kipp_serve$tag.log" 2>&1 &
  local pid=$!
  wait_up "http://127.0.0.1:$port" 300 $pid || { tail -5 "$OUT/kipp_serve$tag.log"; return 1; }
  grep -E "KV budget|engine process" "$OUT/kipp_serve$tag.log" | cut -c1-220
  load "http://127.0.0.1:$port" "serve_kipp$tag"
  if [ "$shape" = 0.6b ]; then
    step "kipp serve 0.6B, Poisson arrivals"
    N=64 load "http://127.0.0.1:$port" serve_kipp06_poisson --sweep-rates 10,20,40 --seed 1
  fi
  kill -TERM $pid; wait $pid
  local budget
  budget=$(grep -oE "KV budget [0-9.]+ GiB" "$OUT/kipp_serve$tag.log" | grep -oE "[0-9.]+" | head -1)
  step "offline LLM.generate, the same workload at kipp serve's KV budget (${budget} GiB)"
  bench --model "$ck" --backend cuda --batch-sizes 1 --prompt-len 16 --gen-len 8 \
    --num-requests "${N:-256}" --min-len 100 --max-len 1024 --kv-cache-memory "${budget}GiB" \
    --json "$OUT/offline$tag.json" 2>&1 | grep -E "hroughput"
}

vllm_serve() {  # $1 shape (default 0.6b): vllm serve (dummy weights, its defaults), serve's load
  [ -n "${VLLM_SITE:-}" ] || { echo "vllm: set VLLM_SITE to vLLM's unpacked tree"; return 1; }
  local shape=${1:-0.6b} tag
  tag=$(echo "$shape" | tr -d .)
  step "vllm serve $shape (dummy weights), defaults, ${N:-256} requests at ${C:-256} streams"
  (
    export PYTHONPATH=$VLLM_SITE PATH=$VLLM_SITE/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
      VLLM_USE_DEEP_GEMM=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT=/tmp/vllm_c \
      TRITON_CACHE_DIR=/tmp/vllm_t TORCHINDUCTOR_CACHE_DIR=/tmp/vllm_i XDG_CACHE_HOME=/tmp/vx
    python "$VLLM_SITE/vc_smoke/make_dummy_qwen3.py" "/tmp/vq$tag" --size "$shape" > /dev/null
    exec vllm serve "/tmp/vq$tag" --load-format dummy --dtype bfloat16 --max-model-len 4096 \
      --served-model-name m --port 8124
  ) > "$OUT/vllm_serve$tag.log" 2>&1 &
  local vpid=$!
  if wait_up http://127.0.0.1:8124 400 $vpid; then
    grep -iE "KV cache|GPU KV|memory" "$OUT/vllm_serve$tag.log" | head -3 | cut -c1-200
    load http://127.0.0.1:8124 "serve_vllm$tag"
  else
    tail -8 "$OUT/vllm_serve$tag.log"
  fi
  kill -TERM $vpid 2>/dev/null; wait $vpid 2>/dev/null
}

llama_long() {  # llama.cpp (.peers/llama.cpp-src.tar.xz) 8B bf16 at the long suite's contexts
  local src=/tmp/llama.cpp ck yarn=/tmp/q8yarn
  if [ ! -x $src/build/bin/llama-bench ]; then
    step "llama.cpp: build (CUDA, sm_90; about 4 minutes on 16 cores)"
    tar xJf .peers/llama.cpp-src.tar.xz -C /tmp || return 1
    (cd $src && cmake -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
      -DCMAKE_BUILD_TYPE=Release > /dev/null && cmake --build build -j16 --target llama-bench \
      > "$OUT/llama_build.log" 2>&1) || { tail -5 "$OUT/llama_build.log"; return 1; }
  fi
  ck=$(ckpt qwen3-8b)
  step "llama.cpp 8B bf16, static YaRN (factor 4 over 32,768) in the GGUF"
  mkdir -p $yarn && cp "$ck"/*.json $yarn/ && ln -sf "$ck"/*.safetensors $yarn/
  python - $yarn/config.json <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
c["max_position_embeddings"] = 131072
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
  [ -f /tmp/q8yarn.gguf ] || PYTHONPATH=$src/gguf-py python $src/convert_hf_to_gguf.py $yarn \
    --outtype bf16 --outfile /tmp/q8yarn.gguf > "$OUT/llama_convert.log" 2>&1 || return 1
  # prefill and decode as separate tests: one list of -p and -d would run every pair (a
  # 131,072-token prompt after a 131,072-token depth); the long prompts skip their warm-up run
  local lb="$src/build/bin/llama-bench -m /tmp/q8yarn.gguf -ngl 99 -fa 1 -o md"
  { $lb -p 2048 -n 0 -r 2; $lb -p 32768,131072 -n 0 -r 1 --no-warmup
    $lb -p 0 -n 64 -d 0,32768,131072 -r 1; } 2>&1 | tee "$OUT/llama_long.md" | grep -E "^\|" \
    | cut -c1-160
}

case "${1:-}" in
env) env_info ;;
tests) env_info; tests ;;
decode) env_info; decode ;;
prefill) env_info; prefill ;;
throughput) env_info; throughput ;;
tp) env_info; tp ;;
kernels) env_info; kernels ;;
mlx) env_info; mlx ;;
mlxtests) env_info; mlxtests ;;
mlxprofile) env_info; mlxprofile ;;
mlxbench) shift; mlx_bench "$@" ;;
long) env_info; long "${2:-cuda}" ;;
llama) env_info; llama_long ;;
serve) env_info; serve "${2:-0.6b}" ;;
vllm) env_info; vllm_serve "${2:-0.6b}" ;;
all)
  env_info; tests; decode; prefill; throughput
  if [ "$(gpus)" -ge 2 ]; then tp; fi
  ;;
*)
  sed -n '2,/^set -u/p' "$0" | sed '$d' | cut -c3-
  exit 2
  ;;
esac
