#!/bin/bash
# One H200 run: llama-3.1-8b at 131,072 tokens under cp:8 (FSDP2 over the 8 ranks, every layer
# checkpointed), ranks 0 and 7 of the ring, each a process on the fake process group.
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
for r in 0 7; do
  timeout 270 python3 cp_model.py 8 $r $O/llama8b_cp8_r$r.json --config ../../models/zoo/hf/llama-3.1-8b.json \
    --seq 131072 --batch 1 --checkpointing --no-trace 2>&1 | grep -v Warning | tail -5
done
