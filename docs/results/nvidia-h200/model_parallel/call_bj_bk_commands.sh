# call BJ
# One GPU, GPT-2 XL, 32 sequences a step as 2 micro-batches of 16: without ac, then with ac.
common="model=gpt2-xl data=shakespeare data.loader=memmap opt.amp.dtype=bfloat16 train.batch_size=32
 train.lr=2e-4 train.min_lr=2e-5 train.max_steps=30 perf.warmup_steps=15 train.log_interval=10
 train.eval_interval=1000000 train.eval_sequences=16 train.checkpoint_interval=0 sample.num_samples=0
 wandb.mode=disabled opt.accum.steps=2"
for run in noac ac; do
  stages="non_blocking,compile,amp,fused,tf32,accum"
  [ $run = ac ] && stages="$stages,ac"
  start=$(date +%s)
  timeout 230 python train.py $common "+opt=[$stages]" hydra.run.dir=$OUT/runs/$run > $OUT/$run.log 2>&1
  echo "$run rc=$? wall=$(( $(date +%s) - start )) s" >> $OUT/summary.txt
done

# call BK
# One GPU, GPT-2 XL, 32 sequences a step: ac at once (call BE's one-GPU row) for 30 steps, then
# no ac (2 x 16) and ac at once for 150 steps.
common="model=gpt2-xl data=shakespeare data.loader=memmap opt.amp.dtype=bfloat16 train.batch_size=32
 train.lr=2e-4 train.min_lr=2e-5 perf.warmup_steps=15 train.log_interval=10
 train.eval_interval=1000000 train.eval_sequences=16 train.checkpoint_interval=0 sample.num_samples=0
 wandb.mode=disabled"
base="non_blocking,compile,amp,fused,tf32"
go() { name=$1; shift; start=$(date +%s)
  timeout $1 python train.py $common "${@:2}" hydra.run.dir=$OUT/runs/$name > $OUT/$name.log 2>&1
  echo "$name rc=$? wall=$(( $(date +%s) - start )) s" >> $OUT/summary.txt; }
go ac_b32_30 170 train.max_steps=30 "+opt=[$base,ac]"
go noac_2x16_150 190 train.max_steps=150 "+opt=[$base,accum]" opt.accum.steps=2
go ac_b32_150 200 train.max_steps=150 "+opt=[$base,ac]"
