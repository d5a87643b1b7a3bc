# Call C: pp levers on GPT-2 large (same call, equal work), then gpt2-4b tp2 against one GPU with ac.
source .whl/setup.sh; set +e
START=$(date +%s)
WL="data=shakespeare data.loader=memmap opt.amp.dtype=bfloat16 train.log_interval=10 train.eval_interval=1000000 train.eval_sequences=16 train.checkpoint_interval=0 sample.num_samples=0 wandb.mode=disabled train.batch_size=16"
OPTS="non_blocking,compile,amp,fused,tf32"
LARGE="model=gpt2-large train.lr=2.5e-4 train.min_lr=2.5e-5 train.max_steps=40 perf.warmup_steps=20"
B4="model=gpt2-4b train.lr=1.6e-4 train.min_lr=1.6e-5 train.max_steps=24 perf.warmup_steps=14"
row() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local left=$(( 500 - ($(date +%s) - START) ))
  if [ $left -lt 60 ]; then echo "$name: skipped, $left s left"; return; fi
  [ $limit -gt $left ] && limit=$left
  local t=$(date +%s)
  timeout $limit "$@" hydra.run.dir=/tmp/c/$name > $OUT/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t )) s: $(python -c "
import json,sys
s=json.load(open('/tmp/c/$name/summary.json'))
print(f\"{s['perf/tokens_per_sec']:,.0f} tok/s p10-p90 {s['perf/tokens_per_sec_p10']:,.0f}-{s['perf/tokens_per_sec_p90']:,.0f} mfu {s['perf/mfu']:.1f} peak {s['mem/peak_allocated_gib']:.2f} GiB busy {s.get('perf/gpu_busy')} bubble {s.get('perf/pp_bubble')}\")" 2>&1 | tail -1)"
}
TR="torchrun --nproc_per_node=2"
row pp_base 100 $TR train.py $WL $LARGE "+opt=[$OPTS,pp]" opt.pp.microbatches=8
row pp_graphs 120 $TR train.py $WL $LARGE "+opt=[$OPTS,pp]" opt.pp.microbatches=8 opt.compile.mode=reduce-overhead
row b4_one_ac 130 python train.py $WL $B4 "+opt=[$OPTS,ac]"
row b4_tp2 130 $TR train.py $WL $B4 "+opt=[$OPTS,tp]"
row pp_cpp 120 env TORCHINDUCTOR_CPP_WRAPPER=1 $TR train.py $WL $LARGE "+opt=[$OPTS,pp]" opt.pp.microbatches=8
row pp_mb4 90 $TR train.py $WL $LARGE "+opt=[$OPTS,pp]" opt.pp.microbatches=4
grep -h -i "warn.*cudagraph\|Unable to hit\|error" $OUT/*.log | sort | uniq -c | head -20
echo "total $(( $(date +%s) - START )) s"
