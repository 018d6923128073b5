#!/bin/bash
# A/B of the AMX bf16 GEMM (pagedllm/csrc/cpu/gemm_amx.cpp) between a git revision (base) and the
# working tree (var) on the bundled model's linears, in one process (benchmarks/amx_linears.cpp):
#   bash benchmarks/amx_linears.sh REV ROWS...    e.g. bash benchmarks/amx_linears.sh HEAD~1 32 48 64
# ITERS (default 20) rounds; prints min / median ms per linear kind and per step. Needs g++ with
# AMX support, the project's .venv (torch headers, libtorch for at::parallel_for), amx_bf16.
set -euo pipefail
rev=$1; shift
root=$(cd "$(dirname "$0")/.." && pwd)
torch=$("$root/.venv/bin/python" -c "import torch, os; print(os.path.dirname(torch.__file__))")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/base"
git -C "$root" archive "$rev" pagedllm/csrc/cpu | tar -x -C "$work/base"
flags=(-O3 -fopenmp -DNDEBUG -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq
       -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=1 -I"$torch/include"
       -I"$torch/include/torch/csrc/api/include")
g++ "${flags[@]}" -Dpagedllm=pagedllm_base -I"$work/base/pagedllm/csrc/cpu" \
    -c "$work/base/pagedllm/csrc/cpu/gemm_amx.cpp" -o "$work/base.o" & base_pid=$!
g++ "${flags[@]}" -Dpagedllm=pagedllm_var -I"$root/pagedllm/csrc/cpu" \
    -c "$root/pagedllm/csrc/cpu/gemm_amx.cpp" -o "$work/var.o" & var_pid=$!
g++ -O2 -std=c++17 -c "$root/benchmarks/amx_linears.cpp" -o "$work/main.o"
wait "$base_pid"
wait "$var_pid"
g++ -fopenmp "$work/main.o" "$work/base.o" "$work/var.o" -L"$torch/lib" -ltorch_cpu -lc10 \
    -Wl,-rpath,"$torch/lib" -o "$work/amx_linears"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$work/amx_linears" "$@"
