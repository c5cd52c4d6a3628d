#!/usr/bin/env bash
# Run (or resume) a seeded study one pre-training seed at a time, niced, so that every arm of a
# seed is pre-trained *and evaluated* before the next seed starts: each finished seed is a piece
# that can be reported and published on its own (`mlsm study report STUDY --to DIR`). Every
# command resumes where the last one stopped: finished stages are skipped by their fingerprints,
# a run continues from its last checkpoint.
#   usage: scripts/run_by_seed.sh STUDY.yaml [SEED ...]   (from the repository root; logs to stdout)
set -euo pipefail
study=${1:?usage: scripts/run_by_seed.sh STUDY.yaml [SEED ...]}
shift
read -r -a arms < <(python -c "import yaml, sys; print(*yaml.safe_load(open(sys.argv[1]))['arms'])" "$study")
if [ "$#" -gt 0 ]; then seeds=("$@"); else
    read -r -a seeds < <(python -c "import yaml, sys; print(*yaml.safe_load(open(sys.argv[1]))['seeds'])" "$study")
fi
for seed in "${seeds[@]}"; do
    echo "[run_by_seed] seed $seed: $(date -u +%FT%TZ)"
    nice -n 19 python -m mlsm study "$study" --arms "${arms[@]/%/-s$seed}" \
        --stages store dictionary pretrain probe finetune blimp readout
done
[ "$#" -gt 0 ] || nice -n 19 python -m mlsm study "$study"  # anything left, then the full report
