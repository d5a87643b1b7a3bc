# One device call running one ablation ladder on the committed tree, its results merged into the
# published json (the json travels with the checkout, so rows of earlier calls are kept):
#   bash docs/results/nvidia-h200/ladder_call.sh <ladder> <timeout s> <ablate.py arguments...>
# $GPT2_RECIPE_COMMIT names the commit the tree is (the device's copy has no .git).
source .whl/setup.sh; set +e
START=$(date +%s)
LADDER=$1; LIMIT=$2; shift 2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/res/nvidia-h200
[ -f docs/results/nvidia-h200/$LADDER.json ] && cp docs/results/nvidia-h200/$LADDER.json $OUT/res/nvidia-h200/
timeout $LIMIT python scripts/ablate.py ladder=$LADDER "$@" out_dir=$OUT/res runs_dir=/tmp/abl > $OUT/ablate.log 2>&1
echo "ablate rc=$? $(( $(date +%s) - START )) s"
grep -E "^\[ablate\]|^\|" $OUT/ablate.log | tail -30
for d in /tmp/abl/*/*; do [ -f $d/summary.json ] && python -c "
import json; s=json.load(open('$d/summary.json'))
print('$d'.split('/')[-1], f\"{s['perf/tokens_per_sec']:,.0f} mfu {s.get('perf/mfu')} busy {s.get('perf/gpu_busy')} kernel {s.get('attention_kernel')} loss {s['train/loss']:.4f} peak {s['mem/peak_allocated_gib']:.2f}\")"; done
cd /tmp && tar czf $OUT/runs.tgz --exclude='*.pt' --exclude='wandb' --exclude='*.bin' abl 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
