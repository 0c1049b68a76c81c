#!/bin/bash
# One H200 run: PyTorch's context parallel traced per simulated rank (the fake process group),
# everything packed into $OUT/cp_traces.tgz.
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1
O=/tmp/cpout; rm -rf $O; mkdir -p $O/src
python3 -c "import torch,transformers;print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $O/versions.txt
D=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
cp -r $D/distributed/tensor/experimental $O/src/ 2>/dev/null; find $O/src -name '__pycache__' -prune -exec rm -rf {} \;
t() { echo "== $*"; timeout 150 "$@" 2>&1 | grep -v Warning | tail -8; }
{
for wr in "2 0" "2 1" "4 0" "4 3"; do set -- $wr
  t python3 cp_probe.py $1 $2 $O/op_w$1_r$2.json --seq 8192
done
t python3 cp_probe.py 4 1 $O/op_w4_r1.json --seq 8192 --configs allgather:1
t python3 cp_probe.py 2 1 $O/op_eff_w2_r1.json --seq 8192 --backend efficient --configs allgather:1,allgather:0
t python3 cp_probe.py 2 1 $O/op_gqa_w2_r1.json --seq 8192 --kv-heads 2 --backend any --configs allgather:1
t python3 cp_probe.py 2 1 $O/op_cudnn_w2_r1.json --seq 8192 --backend cudnn --configs allgather:1
[ -z "$NO_MODEL" ] && t python3 cp_model.py 2 0 $O/model_w2_r0.json
[ -z "$NO_MODEL" ] && t python3 cp_model.py 2 1 $O/model_w2_r1.json
[ -z "$NO_MODEL" ] && t python3 cp_model.py 4 2 $O/model_w4_r2.json
[ -z "$NO_MODEL" ] && t python3 cp_model.py 2 1 $O/model_gqa_w2_r1.json --kv-heads 2
} 2>&1 | tee $O/log.txt
ls -la $O
tar czf ${OUT:-/tmp}/cp_traces.tgz -C $O . && cp $O/log.txt ${OUT:-/tmp}/log.txt
ls -la ${OUT:-/tmp}
