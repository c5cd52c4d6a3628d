#!/usr/bin/env bash
# Run (or resume) studies/cpu_replication_v2.yaml one pre-training seed at a time, niced, so that
# each seed's pair of runs (mlm-sN, mlsm_l5-sN) is pre-trained *and evaluated* before the next
# seed starts: every finished pair is a piece that can be reported and committed on its own
# (`mlsm study report studies/cpu_replication_v2.yaml`, then copy the report into
# docs/results/cpu_replication_v2/). Every command resumes where the last one stopped: finished
# stages are skipped by their fingerprints, a run continues from its last checkpoint.
#   usage: scripts/run_v2.sh [STUDY.yaml]      (from the repository root; logs to stdout)
set -euo pipefail
study=${1:-studies/cpu_replication_v2.yaml}
seeds=$(python -c "import yaml, sys; print(*yaml.safe_load(open(sys.argv[1]))['seeds'])" "$study")
for seed in $seeds; do
    echo "[run_v2] seed $seed: $(date -u +%FT%TZ)"
    nice -n 19 python -m mlsm study "$study" --arms "mlm-s$seed" "mlsm_l5-s$seed" \
        --stages store dictionary pretrain probe finetune blimp readout
done
nice -n 19 python -m mlsm study "$study"  # anything left, then the report over every seed
