#!/usr/bin/env bash
# Run some arms of a study as one piece, niced, then publish the piece into a folder of its own,
# for a study longer than a machine that keeps nothing between sessions but what is committed:
# commit PIECE_DIR, and report over every piece with `mlsm study report STUDY.yaml --from
# PIECE_DIR ... --to DEST` (docs/study.md, "A study longer than a machine's life"). The piece is
# published also when the study stops early or fails (what is done is kept); exit status: the
# study's.
#   usage: scripts/run_piece.sh STUDY.yaml PIECE_DIR ARM [ARM ...]   (e.g. mlm-s1 mlsm_l5-s1)
set -uo pipefail
study=${1:?usage: scripts/run_piece.sh STUDY.yaml PIECE_DIR ARM [ARM ...]}
piece=${2:?usage: scripts/run_piece.sh STUDY.yaml PIECE_DIR ARM [ARM ...]}
shift 2
if [ "$#" -eq 0 ]; then
    echo "scripts/run_piece.sh: name the arms of the piece (with seeds: ARM-sN, e.g. mlm-s1)" >&2
    exit 2
fi
echo "[run_piece] $*: $(date -u +%FT%TZ)"
nice -n 19 python -m mlsm study "$study" --arms "$@" \
    --stages store dictionary pretrain probe finetune blimp readout
status=$?
# only these arms: the study folder may hold other pieces' arms (published in their own folders)
python -m mlsm study report "$study" --to "$piece" --arms "$@" || exit $?
echo "[run_piece] published into $piece: $(date -u +%FT%TZ)"
exit "$status"
