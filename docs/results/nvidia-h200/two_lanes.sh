# One device call on a 2-GPU host running two ladder lanes side by side, one per GPU, each merged
# into its own copy of the published json, returned as lane<gpu>_<ladder>.json (merge the rows
# you publish with measure.ladder_results.publish_call, as one_gpu_calls/README.md's AO–AQ did):
#   BUDGET=<s> bash docs/results/nvidia-h200/two_lanes.sh <ladder> '<GPU 0 args>' '<GPU 1 args>'
# $GPT2_RECIPE_COMMIT names the commit the tree is (the device's copy has no .git).
source .whl/setup.sh; set +e
START=$(date +%s); BUDGET=${BUDGET:-520}; LADDER=$1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
lane() {  # gpu, ablate.py arguments
  export CUDA_VISIBLE_DEVICES=$1
  local out=$OUT/lane$1 runs=/tmp/lane$1-$START
  mkdir -p $out/res/nvidia-h200
  [ -f docs/results/nvidia-h200/$LADDER.json ] && cp docs/results/nvidia-h200/$LADDER.json $out/res/nvidia-h200/
  eval "timeout -k 20 $BUDGET python scripts/ablate.py ladder=$LADDER $2 out_dir=$out/res runs_dir=$runs" > $out/ablate.log 2>&1
  echo "lane $1 rc=$? $(( $(date +%s) - START )) s"
  for d in $runs/*/*; do [ -f $d/summary.json ] && python -c "
import json; s=json.load(open('$d/summary.json'))
print('lane $1', '$d'.split('/')[-1], f\"{s['perf/tokens_per_sec']:,.0f} mfu {s.get('perf/mfu')} loss {s['train/loss']:.4f} peak {s['mem/peak_allocated_gib']:.2f} warm {s.get('compile_warm')}\")"; done
  grep -h "^\[ablate\]" $out/ablate.log | tail -12
  (cd /tmp && tar czf $out/runs.tgz --exclude='*.pt' --exclude='wandb' --exclude='*.bin' $(basename $runs) 2>/dev/null)
  # Eight files come back from a call: each lane's log, runs, printout and merged json.
  cp $out/res/nvidia-h200/$LADDER.json $OUT/lane$1_$LADDER.json 2>/dev/null; rm -rf $out/res
}
lane 0 "$2" > $OUT/lane0.txt 2>&1 & lane 1 "$3" > $OUT/lane1.txt 2>&1; wait
cat $OUT/lane0.txt $OUT/lane1.txt
for l in 0 1; do grep -E "^\|" $OUT/lane$l/ablate.log | tail -8; done
echo "total $(( $(date +%s) - START )) s"
