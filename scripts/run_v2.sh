#!/usr/bin/env bash
# Run (or resume) studies/cpu_replication_v2.yaml one pre-training seed at a time (both arms of a
# seed pre-trained and evaluated before the next), niced: scripts/run_by_seed.sh on v2's file.
#   usage: scripts/run_v2.sh [STUDY.yaml]      (from the repository root; logs to stdout)
set -euo pipefail
exec "$(dirname "$0")/run_by_seed.sh" "${1:-studies/cpu_replication_v2.yaml}"
