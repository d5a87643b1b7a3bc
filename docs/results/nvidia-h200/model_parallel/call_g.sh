# Call G (the same nvidia-h200-x4 machine, warm): lane B measures GPT-2 XL one GPU with ac against
# pp2 on GPUs 0-1, one run each; lane A runs the float8 and attention GPU tests on GPUs 2-3 at the
# lowest CPU priority (nice 19, 4 compile threads) so the host-bound pipeline keeps its CPUs.
source .whl/setup.sh; set +e
START=$(date +%s); BUDGET=${BUDGET:-480}
WL="data=shakespeare data.loader=memmap opt.amp.dtype=bfloat16 train.log_interval=10 train.eval_interval=1000000 train.eval_sequences=16 train.checkpoint_interval=0 sample.num_samples=0 wandb.mode=disabled train.batch_size=16"
OPTS="non_blocking,compile,amp,fused,tf32"
XL="model=gpt2-xl train.lr=2e-4 train.min_lr=2e-5 train.max_steps=30 perf.warmup_steps=15"
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
  export CUDA_VISIBLE_DEVICES=2,3 TORCHINDUCTOR_COMPILE_THREADS=4
  local t=$(date +%s)
  timeout $(( BUDGET - 10 )) nice -n 19 python -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_attention.py tests/unit/test_float8.py > $OUT/lane_a/pytest_float8_attention.log 2>&1
  echo "pytest -m gpu attention+float8 rc=$? $(( $(date +%s) - t )) s: $(tail -1 $OUT/lane_a/pytest_float8_attention.log)"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=0,1
  local TR="torchrun --nproc_per_node=2"
  row xl_one_gpu_ac 200 python train.py $WL $XL "+opt=[$OPTS,ac]"
  row xl_pp2 200 $TR train.py $WL $XL "+opt=[$OPTS,pp]" opt.pp.microbatches=8
  row xl_pp2_mb4 120 $TR train.py $WL $XL "+opt=[$OPTS,pp]" opt.pp.microbatches=4
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
