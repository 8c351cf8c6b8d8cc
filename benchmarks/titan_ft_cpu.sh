#!/usr/bin/env bash
# torchtitan's fault-tolerance mode (torchft across replica groups) with ckptstore as its checkpointer,
# on CPU (gloo): a real torchft lighthouse and NGROUPS replica groups, each its own torchrun job of
# torchtitan's trainer (tests/titan_cpu.py: the CPU launcher), llama3 debug model, checkpoint every
# 2 steps through ckptstore.integrations.torchtitan.ft_checkpointing. docs/torchft.md, "Under torchtitan".
#
#   bash benchmarks/titan_ft_cpu.sh OUT [STEPS] [NGROUPS]
#
# Needs the torchft extra and torchtitan 0.3.0 (+ triton) in the active venv (docs/TESTING.md, "torchtitan").
set -euo pipefail
OUT=${1:?usage: titan_ft_cpu.sh OUT [STEPS] [NGROUPS]}
STEPS=${2:-6}
NGROUPS=${3:-2}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
ASSETS=$(REPO="$REPO" python -c "import sys; sys.path.insert(0, '$REPO/tests'); import test_torchtitan_e2e as e; print(' '.join(e._assets('$OUT/assets')))")
read -r DATA TOK <<<"$ASSETS"
PORT=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
RUST_LOG=warn torchft_lighthouse --bind "127.0.0.1:$PORT" --min_replicas 1 --join_timeout_ms 10000 \
    --quorum_tick_ms 50 > "$OUT/lighthouse.log" 2>&1 &
LH=$!
trap 'kill $LH 2>/dev/null || true' EXIT
export TORCHFT_LIGHTHOUSE="http://127.0.0.1:$PORT" PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
PIDS=()
for G in $(seq 0 $((NGROUPS - 1))); do
  python -m torch.distributed.run --nnodes=1 --nproc-per-node=1 --rdzv-backend=c10d \
      --rdzv-endpoint="127.0.0.1:$((PORT + 1 + G))" "$REPO/tests/titan_cpu.py" \
      --module torchft.llama3 --config llama3_torchft_debugmodel \
      --hf_assets_path "$TOK" --dataloader.dataset_path "$DATA" --training.steps "$STEPS" \
      --training.seq_len 128 --training.local_batch_size 2 --debug.seed 42 --validator.no-enable \
      --profiler.no-enable-profiling --dump_folder "$OUT/dump" \
      --fault_tolerance.enable --fault_tolerance.replica_id "$G" --fault_tolerance.group_size "$NGROUPS" \
      --fault_tolerance.min_replica_size 1 --fault_tolerance.process_group gloo \
      --checkpoint.enable --checkpoint.interval 2 --checkpoint.keep-latest-k 2 \
      --override.imports ckptstore.integrations.torchtitan.ft_checkpointing > "$OUT/group$G.log" 2>&1 &
  PIDS+=($!)
done
RC=0
for P in "${PIDS[@]}"; do wait "$P" || RC=$?; done
python -m ckptstore.cli list "$OUT/dump/checkpoint" || true
grep -h "step:" "$OUT"/group*.log | sed 's/\x1b\[[0-9;]*m//g' | grep -o "step: *[0-9]* *loss: *[-0-9.]*" || true
exit $RC
