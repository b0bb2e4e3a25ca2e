#!/bin/bash
# Warp stall reasons and a SASS opcode histogram of the kernels a profile stage launches.
#   OUT=/tmp bash benchmarks/ncu_report.sh prefill|decode [kernel regex] [launch count]
set -e
export PYTHONPATH=.
STAGE=$1 KERNELS=${2:-jaxinfer|mha} COUNT=${3:-2}
M="gpu__time_duration.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum"
for s in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle dispatch_stall \
         not_selected no_instruction branch_resolving; do
  M="$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
ncu --clock-control none --metrics $M -k regex:"$KERNELS" -c $COUNT python3 benchmarks/profile_kernels.py $STAGE \
  2>&1 | grep -E "\(|smsp|gpu__|lts|dram" | grep -v "==" \
  | sed 's/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio//' | tee $OUT/ncu_stalls.txt
ncu --clock-control none --metrics inst_executed -k regex:"$KERNELS" -c $COUNT --page source --print-source sass \
  --csv python3 benchmarks/profile_kernels.py $STAGE > $OUT/sass.csv 2> /dev/null
python3 benchmarks/sass_histogram.py $OUT/sass.csv | tee $OUT/sass_histogram.txt
