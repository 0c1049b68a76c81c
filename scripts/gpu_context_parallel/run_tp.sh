#!/bin/bash
# One H200 run: context parallel with tensor parallel inside (a (cp, tp) mesh, torchtitan's plan),
# global ranks 0 and K (tp rank 0 at places 0 and 1 of the ring).
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp}
t() { timeout 200 python3 "$@" 2>&1 | grep -v Warning | tail -4; }
t cp_model.py 2 0 $O/tp_model_cp2tp2_r0.json --tp 2
t cp_model.py 2 2 $O/tp_model_cp2tp2_r2.json --tp 2
t cp_model.py 4 0 $O/tp_llama8b_cp4tp2_r0.json --tp 2 --config ../../models/zoo/hf/llama-3.1-8b.json \
  --seq 131072 --batch 1 --checkpointing --no-trace
