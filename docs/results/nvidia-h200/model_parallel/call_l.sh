# Call L (nvidia-h200-x2, nothing beside, the last 600 s of the session): GPT-2 large one GPU,
# tp2 and pp2 (4 micro-batches), one run each.
source .whl/setup.sh; set +e
export GPT2_RECIPE_COMMIT=6e3dc4a22246069038e7aa669be75002a3004701
START=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2
mkdir -p $OUT/res/nvidia-h200 && cp docs/results/nvidia-h200/scaling.json $OUT/res/nvidia-h200/
timeout 470 python scripts/ablate.py ladder=scaling 'steps=[large_one_gpu,large_tp2,large_pp2]' anchor=none repeats=1 \
  timeout_s=220 'extra=["train.max_steps=30","perf.warmup_steps=15"]' out_dir=$OUT/res runs_dir=/tmp/abl > $OUT/ablate.log 2>&1
echo "ablate rc=$? $(( $(date +%s) - START )) s"
grep -E "^\|" $OUT/ablate.log | head -20
for d in /tmp/abl/*/*; do [ -f $d/summary.json ] && python -c "
import json,sys; s=json.load(open('$d/summary.json'))
print('$d'.split('/')[-1], f\"{s['perf/tokens_per_sec']:,.0f} busy {s.get('perf/gpu_busy')} bubble {s.get('perf/pp_bubble')} loss {s['train/loss']:.4f} peak {s['mem/peak_allocated_gib']:.2f}\")"; done
cd /tmp && tar czf $OUT/runs.tgz --exclude='*.pt' --exclude='wandb' abl 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
