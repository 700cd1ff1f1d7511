#!/bin/bash
OUT=${OUT:-/tmp/ov41}; mkdir -p "$OUT"
cd "$(dirname "$0")/../../python"  # benches/python
for rep in 1 2 3; do
  python optim_overlap.py --params 24e6 --steps 6 --modes torch,exact,inbwd --update-threads 2 --json $OUT/before-$rep.json > $OUT/before-$rep.txt 2>&1
  python optim_overlap.py --params 24e6 --steps 6 --modes torch,exact,inbwd,delayed --per-bucket --json $OUT/after-$rep.json > $OUT/after-$rep.txt 2>&1
  python optim_overlap.py --params 24e6 --steps 6 --modes torch,delayed --update-threads 2 --json $OUT/delayed2-$rep.json > $OUT/delayed2-$rep.txt 2>&1
  echo "rep $rep done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/progress.txt
done
echo done >> $OUT/progress.txt
