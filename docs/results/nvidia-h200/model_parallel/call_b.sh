# Call B: profiled GPT-2 large pp2 and tp2 (and one GPU), summaries made on the device.
source .whl/setup.sh; set +e
COMMON="model=gpt2-large data=shakespeare data.loader=memmap train.batch_size=16 train.lr=2.5e-4 train.min_lr=2.5e-5 train.log_interval=1 train.eval_interval=1000000 train.eval_sequences=16 sample.num_samples=0 train.checkpoint_interval=0 wandb.mode=disabled opt.amp.dtype=bfloat16 +prof=trace prof.trace.warmup=2 prof.trace.active=3 prof.trace.record_shapes=false"
OPTS="non_blocking,compile,amp,fused,tf32"
T=$(date +%s)
TORCH_LOGS=recompiles,graph_breaks timeout 150 torchrun --nproc_per_node=2 train.py $COMMON "+opt=[$OPTS,pp]" opt.pp.microbatches=8 train.max_steps=13 prof.trace.wait=8 hydra.run.dir=/tmp/d/pp > $OUT/pp.log 2>&1
echo "pp $(( $(date +%s) - T )) s"; T=$(date +%s)
timeout 150 torchrun --nproc_per_node=2 train.py $COMMON "+opt=[$OPTS,tp]" train.max_steps=22 prof.trace.wait=17 hydra.run.dir=/tmp/d/tp > $OUT/tp.log 2>&1
echo "tp $(( $(date +%s) - T )) s"; T=$(date +%s)
python .whl/diag_summary.py /tmp/d > $OUT/summary.txt 2>&1
timeout 100 python train.py $COMMON "+opt=[$OPTS]" train.max_steps=13 prof.trace.wait=8 hydra.run.dir=/tmp/d1/one > $OUT/one.log 2>&1
echo "one $(( $(date +%s) - T )) s"
python .whl/diag_summary.py /tmp/d1 > $OUT/summary_one.txt 2>&1
grep -h "step \|report\]" $OUT/*.log | tail -40
ls -la /tmp/d/*/ $OUT
