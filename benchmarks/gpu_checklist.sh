#!/usr/bin/env bash
# The GPU figures of ../shared/gpu-checklist.md in one call on one GPU machine, in order of value, each under its
# own time limit (a failed or slow item leaves the others' figures). Logs go to $OUT (default /tmp/gpu-checklist);
# the JSON lines of every item are printed last.
#
#   bash benchmarks/gpu_checklist.sh              # about 9 minutes on one H100 (docs/performance.md)
#
# A machine without this project's packages takes them as wheels from .whl/ (docs/performance.md says which).
set -u
OUT=${OUT:-/tmp/gpu-checklist}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
PY=${PY:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi

item() {  # item NAME SECONDS ARGS...: one benchmark, its log in $OUT/NAME.log
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" $PY "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    # a killed parent leaves its child benchmark process holding the GPU: end it before the next item
    [ $rc -ne 0 ] && pkill -9 -f "benchmarks/bench_" && sleep 2
    echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    return $rc
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch, transformers, deepspeed, peft; print(torch.__version__, transformers.__version__,
deepspeed.__version__, peft.__version__)"; } >"$OUT/env.log" 2>&1

# 1. Llama-3-8B's shape, LoRA, NPO + KL: reference-free against a resident reference with full fp32 logits
item llama3_8b_lora 150 benchmarks/bench_reference_free.py --llama3-8b --lora --steps 3
# 2. The same pair at 0.95B, whole model: memory (each in its own process), then step time interleaved
item pair_1b 100 benchmarks/bench_reference_free.py --hidden 2048 --layers 16 --vocab 32000 --steps 5
item pair_1b_interleaved 80 benchmarks/bench_reference_free.py --hidden 2048 --layers 16 --vocab 32000 \
    --steps 8 --interleave
# 3 and 4. T-GA, S-GA over GA and the MFU of a GA step beside them (three engines: 8 + 8 x 512 is what fits), then
# the MFU of GA alone at the batches that fill the GPU
item steps_1b 150 benchmarks/bench_unlearn.py --only steps --hidden 2048 --layers 16 --vocab 32000 --batch 8 \
    --seq 512 --steps 6 --no-npo --profile
for b in 16 32; do
    item mfu_1b_batch$b 80 benchmarks/bench_unlearn.py --only steps --hidden 2048 --layers 16 --vocab 32000 \
        --batch $b --seq 512 --steps 6 --no-npo --variants ga
done
# 4. Attribution (both passes) over one plain forward pass, 0.95B, 8 x 512 tokens a batch
item attribution_1b 50 benchmarks/bench_attribution.py --only passes --hidden 2048 --layers 16 --vocab 32000 \
    --batch 8 --seq 512 --batches 4 --repeats 5
# 6. Liger-Kernel's fused linear cross-entropy against the chunked head, per-token weights, Llama-3-8B's head
item fused_head 50 benchmarks/bench_fused_head.py

cat "$OUT/env.log"
for f in "$OUT"/*.log; do
    grep -h '^{' "$f" | sed "s|^|$(basename "$f" .log): |"
done
cat "$OUT/summary.txt"
