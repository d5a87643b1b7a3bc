# Calls I-L (nvidia-h200-x2, nothing beside): one scaling-ladder call each, run as
#   bash calls_i_l.sh <timeout s> <ablate.py arguments...>
# I: 540 'steps=[xl_pp2,xl_pp2_24]' anchor=none repeats=2 timeout_s=220 'extra=["train.max_steps=40","perf.warmup_steps=20"]'
#    (xl_pp2 then the split by FLOPs, 25/23; xl_pp2_24 the even split, now xl_pp2's default)
# J: 540 'steps=[one_gpu,ddp,fsdp]' repeats=2 timeout_s=200
# K: 540 'steps=[xl_one_gpu,xl_pp2_24]' anchor=none repeats=2 timeout_s=220 'extra=["train.max_steps=40","perf.warmup_steps=20"]'
# L: 470 'steps=[large_one_gpu,large_tp2,large_pp2]' anchor=none repeats=1 timeout_s=220 'extra=["train.max_steps=30","perf.warmup_steps=15"]'
# (each call ran these lines as its own script, the ablate arguments written in; K and L began
# with `rm -rf /tmp/abl`, so that the tarred runs were the call's own).
source .whl/setup.sh; set +e
export GPT2_RECIPE_COMMIT=6e3dc4a22246069038e7aa669be75002a3004701
START=$(date +%s)
LIMIT=$1; shift
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -2
mkdir -p $OUT/res/nvidia-h200 && cp docs/results/nvidia-h200/scaling.json $OUT/res/nvidia-h200/
timeout $LIMIT python scripts/ablate.py ladder=scaling "$@" out_dir=$OUT/res runs_dir=/tmp/abl > $OUT/ablate.log 2>&1
echo "ablate rc=$? $(( $(date +%s) - START )) s"
grep -E "^\|" $OUT/ablate.log | head -20
for d in /tmp/abl/*/*; do [ -f $d/summary.json ] && python -c "
import json,sys; s=json.load(open('$d/summary.json'))
print('$d'.split('/')[-1], f\"{s['perf/tokens_per_sec']:,.0f} busy {s.get('perf/gpu_busy')} bubble {s.get('perf/pp_bubble')} loss {s['train/loss']:.4f} peak {s['mem/peak_allocated_gib']:.2f}\")"; done
cd /tmp && tar czf $OUT/runs.tgz --exclude='*.pt' --exclude='wandb' abl 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
