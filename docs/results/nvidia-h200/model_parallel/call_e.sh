# Call E (nvidia-h200-x4, two lanes of 2 GPUs): lane A runs the GPU tests on GPUs 0-1 while lane B
# measures the GPT-2 large rows on GPUs 2-3 (one run each, same call): the pipeline compiled one
# graph per stage, tp's pending gradients in one all-reduce, async tp.
source .whl/setup.sh; set +e
START=$(date +%s); BUDGET=${BUDGET:-520}
WL="data=shakespeare data.loader=memmap opt.amp.dtype=bfloat16 train.log_interval=10 train.eval_interval=1000000 train.eval_sequences=16 train.checkpoint_interval=0 sample.num_samples=0 wandb.mode=disabled train.batch_size=16"
OPTS="non_blocking,compile,amp,fused,tf32"
LARGE="model=gpt2-large train.lr=2.5e-4 train.min_lr=2.5e-5 train.max_steps=30 perf.warmup_steps=15"
row() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ $left -lt 60 ]; then echo "$name: skipped, $left s left"; return; fi
  [ $limit -gt $left ] && limit=$left
  local t=$(date +%s)
  timeout $limit "$@" hydra.run.dir=/tmp/e/$name > $OUT/lane_b/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t )) s: $(python -c "
import json
s=json.load(open('/tmp/e/$name/summary.json'))
print(f\"{s['perf/tokens_per_sec']:,.0f} tok/s p10-p90 {s['perf/tokens_per_sec_p10']:,.0f}-{s['perf/tokens_per_sec_p90']:,.0f} mfu {s['perf/mfu']:.1f} peak {s['mem/peak_allocated_gib']:.2f} GiB busy {s.get('perf/gpu_busy')} bubble {s.get('perf/pp_bubble')} loss {s['train/loss']:.4f}\")" 2>&1 | tail -1)"
}
lane_a() {
  export CUDA_VISIBLE_DEVICES=0,1 TORCHINDUCTOR_COMPILE_THREADS=8
  local t=$(date +%s)
  timeout 380 python -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/unit/test_float8.py --ignore=tests/unit/test_attention.py > $OUT/lane_a/pytest_gpu.log 2>&1
  echo "pytest -m gpu (no float8, attention) rc=$? $(( $(date +%s) - t )) s: $(tail -1 $OUT/lane_a/pytest_gpu.log)"
  t=$(date +%s); local left=$(( BUDGET - (t - START) ))
  timeout $left python -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_attention.py > $OUT/lane_a/pytest_attention.log 2>&1
  echo "pytest -m gpu attention rc=$? $(( $(date +%s) - t )) s: $(tail -1 $OUT/lane_a/pytest_attention.log)"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=2,3
  local TR="torchrun --nproc_per_node=2"
  row large_one_gpu 120 python train.py $WL $LARGE "+opt=[$OPTS]"
  row large_pp2 110 $TR train.py $WL $LARGE "+opt=[$OPTS,pp]" opt.pp.microbatches=8
  row large_tp2_async 160 $TR train.py $WL $LARGE "+opt=[$OPTS,tp]" opt.tp.async_tp=true
  row large_tp2 150 $TR train.py $WL $LARGE "+opt=[$OPTS,tp]"
  row large_pp2_mb4 100 $TR train.py $WL $LARGE "+opt=[$OPTS,pp]" opt.pp.microbatches=4
}
mkdir -p $OUT/lane_a $OUT/lane_b
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
lane_a > $OUT/lane_a.txt 2>&1 &
lane_b 2>&1 | tee $OUT/lane_b.txt
wait
cat $OUT/lane_a.txt
grep -h -i "error\|Traceback" $OUT/lane_b/*.log | sort | uniq -c | sort -rn | head -15
grep -E "^(FAILED|ERROR)" $OUT/lane_a/*.log | head -20
cd $OUT && tar czf lane_a.tgz lane_a && tar czf lane_b.tgz lane_b && rm -rf lane_a lane_b
echo "total $(( $(date +%s) - START )) s"
