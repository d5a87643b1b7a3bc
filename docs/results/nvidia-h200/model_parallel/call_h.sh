# Call H (nvidia-h200-x4, two lanes): lane A measures GPT-2 XL one GPU with ac against pp2 (stages
# split by FLOPs, 25/23) on GPUs 0-1 through the scaling ladder, 2 interleaved repeats, no anchor
# (the XL rows compare with xl_one_gpu); lane B runs the float8 and tp GPU tests on GPUs 2-3 at the
# lowest CPU priority (the XL rows keep the GPUs busy: the host is not their limit).
source .whl/setup.sh; set +e
START=$(date +%s)
lane_a() {
  export CUDA_VISIBLE_DEVICES=0,1
  mkdir -p $OUT/res/nvidia-h200 && cp docs/results/nvidia-h200/scaling.json $OUT/res/nvidia-h200/
  timeout 520 python scripts/ablate.py ladder=scaling 'steps=[xl_one_gpu,xl_pp2]' anchor=none repeats=2 \
    timeout_s=220 'extra=["train.max_steps=40","perf.warmup_steps=20"]' out_dir=$OUT/res runs_dir=/tmp/abl > $OUT/lane_a.log 2>&1
  echo "ablate rc=$? $(( $(date +%s) - START )) s"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=2,3 TORCHINDUCTOR_COMPILE_THREADS=4
  timeout 530 nice -n 19 python -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/unit/test_float8.py --ignore=tests/unit/test_attention.py --ignore=tests/distributed/test_tp.py > $OUT/lane_b.log 2>&1
  echo "pytest -m gpu core rc=$? $(( $(date +%s) - START )) s: $(tail -1 $OUT/lane_b.log)"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
lane_b > $OUT/lane_b.txt 2>&1 &
lane_a
wait
cat $OUT/lane_b.txt
grep -E "^(FAILED|ERROR)" $OUT/lane_b.log | head -20
grep -E "^\|" $OUT/lane_a.log | head -20
for d in /tmp/abl/*/*; do [ -f $d/summary.json ] && python -c "
import json,sys; s=json.load(open('$d/summary.json'))
print('$d'.split('/')[-1], f\"{s['perf/tokens_per_sec']:,.0f} busy {s.get('perf/gpu_busy')} bubble {s.get('perf/pp_bubble')} loss {s['train/loss']:.4f} peak {s['mem/peak_allocated_gib']:.2f}\")"; done
cd /tmp && tar czf $OUT/runs.tgz --exclude='*.pt' --exclude='wandb' abl 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
