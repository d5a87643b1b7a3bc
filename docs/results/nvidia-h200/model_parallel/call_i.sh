# Call I (the same nvidia-h200-x4 lease, warm, nothing beside): GPT-2 XL pp2, 4 micro-batches,
# stages split by FLOPs (25/23) against the split by parameters (24/24), interleaved A B A B on
# GPUs 0-1. Call H measured the split by FLOPs beside the core GPU tests: 0.681 per GPU, runs
# 56.3 K and 50.9 K apart, against 0.790 for 24/24 in call G.
source .whl/setup.sh; set +e
START=$(date +%s); BUDGET=${BUDGET:-545}
export CUDA_VISIBLE_DEVICES=0,1
WL="data=shakespeare data.loader=memmap opt.amp.dtype=bfloat16 train.log_interval=10 train.eval_interval=1000000 train.eval_sequences=16 train.checkpoint_interval=0 sample.num_samples=0 wandb.mode=disabled train.batch_size=16"
OPTS="non_blocking,compile,amp,fused,tf32"
XL="model=gpt2-xl train.lr=2e-4 train.min_lr=2e-5 train.max_steps=30 perf.warmup_steps=15"
row() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ $left -lt 60 ]; then echo "$name: skipped, $left s left"; return; fi
  [ $limit -gt $left ] && limit=$left
  local t=$(date +%s)
  timeout $limit "$@" hydra.run.dir=/tmp/e/$name > $OUT/runs/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t )) s: $(python -c "
import json
s=json.load(open('/tmp/e/$name/summary.json'))
print(f\"{s['perf/tokens_per_sec']:,.0f} tok/s p10-p90 {s['perf/tokens_per_sec_p10']:,.0f}-{s['perf/tokens_per_sec_p90']:,.0f} step {s.get('perf/step_ms')} busy {s.get('perf/gpu_busy')} bubble {s.get('perf/pp_bubble')} peak {s['mem/peak_allocated_gib']:.2f} GiB loss {s['train/loss']:.4f}\")" 2>&1 | tail -1)"
}
mkdir -p $OUT/runs
TR="torchrun --standalone --nproc_per_node=2"
for r in 0 1; do
  row xl_pp2_flops_r$r 160 $TR train.py $WL $XL "+opt=[$OPTS,pp]" opt.pp.microbatches=4
  row xl_pp2_24_r$r 160 $TR train.py $WL $XL "+opt=[$OPTS,pp]" opt.pp.microbatches=4 "opt.pp.split=[24]"
done
grep -h -i "Traceback\|Error" $OUT/runs/*.log | sort | uniq -c | sort -rn | head
cd /tmp/e && tar czf $OUT/runs_metrics.tgz */metrics.jsonl */summary.json 2>/dev/null; cd $OUT && tar czf runs.tgz runs && rm -rf runs
echo "total $(( $(date +%s) - START )) s"
