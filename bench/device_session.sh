#!/usr/bin/env bash
# The prepared run for a lent GPU machine (docs/device_check.md, "On a lent GPU machine"), at most 9.5 minutes:
# unpack the dependency bundle (`python bench/device_bundle.py` builds .device/site.tar.xz here), then
#   1. the device check (bench/device_check.py): env, the recipe's generation, the recipe's train step as the
#      trainer resolves it on the device (`train_step_auto`: checkpointing, microbatch and attention `auto`), the
#      quickstart with both roles on the GPU;
#   2. bench/generation.py at the recipe's shape: today's scan sampler against the baseline in
#      .device/baseline_sampler/ (`git show REV:src/marinrl/inference/{sampler,decoder}.py`), paired calls;
#   3. if time is left, the same shape with the decode kernel against the XLA attention, paired calls
#      (`--modes scan,scan_kernel`: inference.attention gpu_kernel vs xla; a run of its own, so that a kernel that
#      fails to lower loses only this step);
#   4. if time is left, the same shape with XLA's command buffers for WHILE and CONDITIONAL (the decode loop as
#      a device graph).
# Every JSON line and log goes to $1 (default $OUT). Run from the repo's root:
#   bash bench/device_session.sh "$OUT"
set -u
out=${1:-${OUT:?give an output folder}}
mkdir -p "$out" /tmp/site
started=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - started) )); }
tar xJf .device/site.tar.xz -C /tmp/site || { echo "no dependency bundle: run python bench/device_bundle.py here"; exit 2; }
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/bench/device_compat${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia_smi.csv" 2>&1
python3 bench/device_check.py --sections env,generation,train_step_auto,quickstart --budget_s 430 \
    --section_s generation=200 --section_s train_step_auto=80 --section_s quickstart=130 \
    --out "$out/device_check.json" > "$out/device_check.log" 2>&1
echo "device check: exit $? after $(( $(date +%s) - started )) s"
timeout "$(left 560)" python3 bench/generation.py --shape recipe --baseline .device/baseline_sampler --calls 4 \
    > "$out/generation_ab.log" 2>&1
echo "generation A/B: exit $? after $(( $(date +%s) - started )) s"
if [ "$(left 570)" -gt 100 ]; then
    timeout "$(left 570)" python3 bench/generation.py --shape recipe --modes scan,scan_kernel --calls 3 \
        > "$out/generation_kernel.log" 2>&1
    echo "generation, decode kernel vs XLA attention: exit $? after $(( $(date +%s) - started )) s"
fi
if [ "$(left 570)" -gt 80 ]; then
    XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" timeout "$(left 570)" \
        python3 bench/generation.py --shape recipe --calls 4 > "$out/generation_command_buffers.log" 2>&1
    echo "generation with command buffers: exit $? after $(( $(date +%s) - started )) s"
fi
tail -c 1500 "$out/generation_ab.log"
if [ -f "$out/generation_kernel.log" ]; then tail -c 1500 "$out/generation_kernel.log"; fi
