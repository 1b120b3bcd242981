#!/usr/bin/env bash
# Prints the processor model and the instruction-set flags that change XLA:CPU's numerics and speed (AVX-512,
# its bf16 / VNNI extensions, AMX), on one line: `.ci/run` prints it first and benchmarks record it.
field() { lscpu 2>/dev/null | sed -n "s/^$1:[[:space:]]*//p" | head -n 1; }
model="$(field 'Model name') (family $(field 'CPU family'), model $(field 'Model'))"
flags="$(grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_vnni|avx512_fp16|avx_vnni|amx_bf16|amx_int8|amx_tile' \
         /proc/cpuinfo 2>/dev/null | sort -u | tr "\n" " " | sed "s/ $//")"
echo "cpu: ${model} ($(nproc) cores); flags: ${flags:-none of avx2/avx512/amx}"
