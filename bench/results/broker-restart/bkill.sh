#!/bin/bash
# The quickstart, its ZMQ broker SIGKILLed once the learner passed version 20; `asyncrl up`
# restarts the broker and the run must go on and learn. Extra arguments go to `asyncrl up`
# (e.g. --set buffer.spill_path="" for a broker without its spill file, the default before
# a4a169d). Usage: bench/results/broker-restart/bkill.sh RUN_NAME [--set K=V ...]
# (output in /tmp/bkill/RUN_NAME.out)
cd "$(git rev-parse --show-toplevel)"
mkdir -p /tmp/bkill
rm -rf /tmp/bkill/runs/$1
.venv/bin/asyncrl up configs/quickstart.toml --set run.output_dir=/tmp/bkill/runs --set run.name=$1 --set eval.stop_at_accuracy=1.0 "${@:2}" > /tmp/bkill/$1.out 2>&1 &
UP=$!
for i in $(seq 1 120); do
  sleep 1
  if grep -qE "^v(2[0-9]|[3-9][0-9])" /tmp/bkill/$1.out; then break; fi
done
B=$(pgrep -f "asyncrl.cli buffer" | head -1)
echo "killing buffer $B at $(grep -E '^v[0-9]' /tmp/bkill/$1.out | tail -1 | cut -c1-5)"
kill -9 $B
wait $UP
echo "up rc=$?"
