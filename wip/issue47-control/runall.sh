p=29600
for spec in "2 stop 40" "2 gil 45" "2 missing 5" "4 kill 15" "4 missing 5" "2 idle 15"; do
  set -- $spec; p=$((p+1))
  echo "== n=$1 mode=$2 timeout=$3"
  /usr/bin/time -f "wall %e" env ACCELERATE_USE_CPU=true timeout 150 /work/wt/control/.venv/bin/torchrun --nproc_per_node $1 --master_port $p proto.py $2 $3 > out_$1_$2.log 2>&1
  grep -a "RESULT\|^wall" out_$1_$2.log
done
