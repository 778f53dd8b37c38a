#!/usr/bin/env bash
# What plots and loggers add to a run's wall time: a 1-step MNIST run on 2 processes, three
# rounds, the variants interleaved in each round so that a slow spell hits all of them alike.
#
#   bash benchmarks/observability.sh [DDPKIT]    # DDPKIT: the command (default: .venv/bin/ddpkit)
#
# Wall time is from spawn to exit: start-up, the step, one evaluation of the test set, exit.
set -euo pipefail
DDPKIT=${1:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/ddpkit}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
for round in 1 2 3; do
  for variant in "--no-plots" "" "--log tensorboard,csv"; do
    start=$(date +%s.%N)
    # shellcheck disable=SC2086  # the variant is two words, or none
    "$DDPKIT" train --dataset mnist --nproc 2 --max-steps 1 --quiet $variant --run-dir "$WORK/r$round${variant//[^a-z]/}" >/dev/null
    end=$(date +%s.%N)
    printf 'round %d  %-24s wall %.2f s\n' "$round" "[${variant:-plots}]" "$(echo "$end - $start" | bc)"
  done
done
