# Call D: GPT-2 large tp2 after summing the pending gradients in one all-reduce, against one GPU in the
# same call; the tp run saves its sharded checkpoint at the end (the checkpointing package on a GPU).
source .whl/setup.sh; set +e
START=$(date +%s)
WL="data=shakespeare data.loader=memmap opt.amp.dtype=bfloat16 train.log_interval=10 train.eval_interval=1000000 train.eval_sequences=16 sample.num_samples=0 wandb.mode=disabled train.batch_size=16 model=gpt2-large train.lr=2.5e-4 train.min_lr=2.5e-5 train.max_steps=30 perf.warmup_steps=15"
OPTS="non_blocking,compile,amp,fused,tf32"
report() { python -c "
import json
s=json.load(open('/tmp/d/$1/summary.json'))
print('$1', f\"{s['perf/tokens_per_sec']:,.0f} tok/s p10-p90 {s['perf/tokens_per_sec_p10']:,.0f}-{s['perf/tokens_per_sec_p90']:,.0f} mfu {s['perf/mfu']:.1f} peak {s['mem/peak_allocated_gib']:.2f} GiB busy {s.get('perf/gpu_busy')} loss {s['train/loss']:.4f} val {s['val/loss']:.4f}\")" 2>&1 | tail -1; }
T=$(date +%s); timeout 140 torchrun --nproc_per_node=2 train.py $WL "+opt=[$OPTS,tp]" train.checkpoint_interval=1000 hydra.run.dir=/tmp/d/tp2 > $OUT/tp2.log 2>&1; echo "tp2 rc=$? $(( $(date +%s) - T )) s"; report tp2
ls /tmp/d/tp2 | head; grep -h "checkpoint\|saved" $OUT/tp2.log | tail -3

echo "total $(( $(date +%s) - START )) s"
