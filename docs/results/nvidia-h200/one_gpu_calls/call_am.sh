# Call AM (2 H200s, one lane per GPU): lane A measures the float8_large ladder's bf16 and
# tensorwise rows with 2 interleaved repeats; lane B times GPT-2 XL (the sizes ladder's gpt2_xl
# row) under Inductor's default mode and under max-autotune-no-cudagraphs (GEMM autotuning; CUDA
# graphs buy nothing on a GPU-bound step), one run each, each with its compile time.
source .whl/setup.sh; set +e
START=$(date +%s); BUDGET=${BUDGET:-510}
XL="data=synthetic opt.amp.dtype=bfloat16 train.max_steps=50 train.log_interval=10 train.eval_interval=1000000 train.eval_sequences=16 train.checkpoint_interval=0 perf.warmup_steps=20 perf.memory_cap_gib=79 sample.num_samples=0 +opt=[non_blocking,compile,amp,fused,tf32,custom_op] model=gpt2-xl train.batch_size=16 train.lr=2.0e-4 train.min_lr=2.0e-5 wandb.mode=disabled"
mkdir -p $OUT/lane_a $OUT/lane_b $OUT/resA/nvidia-h200
lane_a() {
  export CUDA_VISIBLE_DEVICES=0
  cp docs/results/nvidia-h200/float8_large.json $OUT/resA/nvidia-h200/
  timeout $(( BUDGET - 5 )) python scripts/ablate.py ladder=float8_large 'steps=[bf16,tensorwise]' repeats=2 out_dir=$OUT/resA runs_dir=/tmp/ablA > $OUT/lane_a/ablate.log 2>&1
  echo "lane A ablate rc=$? $(( $(date +%s) - START )) s"
}
xl_row() {  # name mode
  local left=$(( BUDGET - ($(date +%s) - START) )) t=$(date +%s)
  [ $left -lt 60 ] && { echo "$1: skipped, $left s left"; return; }
  timeout $left python train.py $XL opt.compile.mode=$2 hydra.run.dir=/tmp/xl/$1 > $OUT/lane_b/$1.log 2>&1
  echo "$1 rc=$? $(( $(date +%s) - t )) s: $(python -c "
import json; s=json.load(open('/tmp/xl/$1/summary.json'))
print(f\"{s['perf/tokens_per_sec']:,.0f} tok/s p10-p90 {s['perf/tokens_per_sec_p10']:,.0f}-{s['perf/tokens_per_sec_p90']:,.0f} mfu {s['perf/mfu']:.1f} peak {s['mem/peak_allocated_gib']:.2f} GiB\")" 2>&1 | tail -1)"
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=1
  xl_row xl_default default
  xl_row xl_max_autotune max-autotune-no-cudagraphs
}
lane_a & lane_b; wait
grep -E "^\|" $OUT/lane_a/ablate.log | tail -8
grep -h "compile\|\[perf\]" $OUT/lane_b/*.log | head -12
tar czf $OUT/resA.tgz -C $OUT resA && rm -rf $OUT/resA
echo "total $(( $(date +%s) - START )) s"
