#!/usr/bin/env bash
# Issue #46's measurements in one command on a lent GPU machine: the GPU tests, then the
# benchmarks of `--plan round_three` (see [round three] in tools/gpu_check.py), inside a
# deadline, with the report, the log and a tarball of the raw files (JSON, logs, JUnit XML)
# written to OUT_DIR as each part ends.
#
#   bash tools/gpu_wheels.sh                        # first, where the registries are reachable
#   bash tools/gpu_round_three.sh OUT_DIR [DEADLINE_S] [more tools/gpu_check.py options]
#
# DEADLINE_S (default 540) covers the whole check, the offline install included; give the
# command itself a little more (the tarball takes seconds). A second call on the same machine
# reuses the environment and measures what the first left out, e.g.
#   bash tools/gpu_round_three.sh OUT_DIR 540 --skip-tests --benchmarks hf_trainer_peer
set -uo pipefail

out="${1:?usage: bash tools/gpu_round_three.sh OUT_DIR [DEADLINE_S] [gpu_check options]}"
deadline="${2:-540}"
shift $(($# < 2 ? $# : 2))
cd "$(dirname "$0")/.."
mkdir -p "$out"
work=outputs/gpu_check
python3 tools/gpu_check.py --wheels .whl --test-workers 8 --plan round_three \
    --deadline "$deadline" --work-dir "$work" --report "$out/gpu_report_round_three.md" \
    --invoked-as "bash tools/gpu_round_three.sh OUT_DIR $deadline $*" \
    --note "issue #46, round three" "$@" 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
tar -czf "$out/gpu_check_work.tar.gz" "$work"
exit "$status"
