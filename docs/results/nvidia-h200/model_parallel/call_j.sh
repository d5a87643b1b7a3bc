# Call J (nvidia-h200-x2, nothing beside): GPT-2 124M one GPU, DDP and FSDP2 on 2 GPUs, 2 interleaved
# repeats each, with the ladder's non_blocking and DDP's 100 MiB buckets.
source .whl/setup.sh; set +e
export GPT2_RECIPE_COMMIT=6e3dc4a22246069038e7aa669be75002a3004701
START=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2
mkdir -p $OUT/res/nvidia-h200 && cp docs/results/nvidia-h200/scaling.json $OUT/res/nvidia-h200/
timeout 540 python scripts/ablate.py ladder=scaling 'steps=[one_gpu,ddp,fsdp]' repeats=2 \
  timeout_s=200 out_dir=$OUT/res runs_dir=/tmp/abl > $OUT/ablate.log 2>&1
echo "ablate rc=$? $(( $(date +%s) - START )) s"
grep -E "^\|" $OUT/ablate.log | head -20
for d in /tmp/abl/*/*; do [ -f $d/summary.json ] && python -c "
import json,sys; s=json.load(open('$d/summary.json'))
print('$d'.split('/')[-1], f\"{s['perf/tokens_per_sec']:,.0f} busy {s.get('perf/gpu_busy')} bubble {s.get('perf/pp_bubble')} loss {s['train/loss']:.4f} peak {s['mem/peak_allocated_gib']:.2f}\")"; done
cd /tmp && tar czf $OUT/runs.tgz --exclude='*.pt' --exclude='wandb' abl 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
