#!/usr/bin/env bash
# v3's equal-compute diagnostic for one seed (docs/results/cpu_replication_v3/README.md, "Equal
# compute"): mlsm_l5-sSEED's 69 % checkpoint (0.994x MLM's training FLOPs at 100 %) read out by a
# fresh factored head of the study's rank and by MLSM's own latent probe, with the study's probe
# settings, niced; each fit's probe.json is copied into the page's equal_compute/ folder to commit.
# A fit already recorded there is not run again (it says so); a failed fit is one line on stderr
# naming its log, exit 2. Exploratory: outside the study's hypotheses.
#   usage: scripts/equal_compute_probes.sh SEED   (from the repository root, once mlsm_l5-sSEED is
#          pre-trained; runs/ is the study's; about 35 min per fit on two shared CPU cores)
set -euo pipefail
seed=${1:?usage: scripts/equal_compute_probes.sh SEED}
study=studies/cpu_replication_v3.yaml
run="runs/studies/cpu_replication_v3/runs/mlsm_l5-s${seed}@69%"
records=docs/results/cpu_replication_v3/equal_compute
# the study's probe group as `mlsm probe` flags (`controls` aside), its `rank` first
read -ra recipe <<< "$(python -c '
import sys, yaml
probe = yaml.safe_load(open(sys.argv[1]))["probe"]
flags = {k: ",".join(map(str, v)) if isinstance(v, list) else v
         for k, v in probe.items() if k not in ("controls", "rank")}
print(probe["rank"], " ".join(f"--{k.replace(chr(95), chr(45))} {v}" for k, v in flags.items()))
' "$study")"
rank=${recipe[0]}
recipe=("${recipe[@]:1}")
mkdir -p runs/diagnostics "$records"
for head in factored latent; do
    name="mlsm_l5-s${seed}@69pct-${head}"
    if [ -f "$records/$name.json" ]; then  # a committed result: refit only when asked to
        echo "[equal_compute] $name: recorded already (delete $records/$name.json to fit again)"
        continue
    fi
    width=()
    [ "$head" = factored ] && width=(--rank "$rank")
    echo "[equal_compute] $name: $(date -u +%FT%TZ)"
    log="runs/diagnostics/$name.log"
    if ! nice -n 10 mlsm probe "$run" --head "$head" "${width[@]}" "${recipe[@]}" \
        --out "runs/diagnostics/$name" > "$log" 2>&1; then
        echo "scripts/equal_compute_probes.sh: $name failed: $(tail -n 1 "$log") (log: $log)" >&2
        exit 2
    fi
    cp "runs/diagnostics/$name/probe.json" "$records/$name.json"
done
echo "[equal_compute] seed $seed: records in $records: $(date -u +%FT%TZ)"
