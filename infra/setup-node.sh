#!/usr/bin/env bash
# Installs marinrl on one machine: Python 3.11 in ~/venv (through uv, whatever Python the image has),
# the repository's pinned versions (constraints.txt) and the jax build for the accelerator.
#
#   bash infra/setup-node.sh cpu|tpu|cuda12 [repo dir, default ~/marinrl]
#
# The cluster configs run it on every node after `ray up` copied the checkout to ~/marinrl; on a GPU
# box of your own run it by hand from the checkout: `bash infra/setup-node.sh cuda12 .`
# Idempotent: a second run only reinstalls what changed.
set -euo pipefail

accelerator="${1:?usage: setup-node.sh cpu|tpu|cuda12 [repo dir]}"
repo="$(cd "${2:-$HOME/marinrl}" && pwd)"
case "$accelerator" in
  cpu) jax="jax" ;;              # the head node: it runs the job's driver, never a model
  tpu) jax="jax[tpu]" ;;         # libtpu, for TPU VMs (v5e, v5p, v6e)
  cuda12) jax="jax[cuda12]" ;;   # CUDA 12.8+ and cuDNN from pip; needs an NVIDIA driver >= 570
  *) echo "setup-node.sh: unknown accelerator '$accelerator' (cpu, tpu or cuda12)" >&2; exit 2 ;;
esac
[ -f "$repo/constraints.txt" ] || { echo "setup-node.sh: $repo/constraints.txt not found: is $repo a marinrl checkout?" >&2; exit 2; }

command -v uv >/dev/null || [ -x "$HOME/.local/bin/uv" ] || curl -LsSf https://astral.sh/uv/install.sh | sh
uv="$(command -v uv || echo "$HOME/.local/bin/uv")"
"$uv" venv --allow-existing --seed --python 3.11 "$HOME/venv"
# Ray's commands run in an interactive login shell: `ray` and `marinrl` come from ~/venv there.
grep -qs '# marinrl venv' "$HOME/.bashrc" || echo 'export PATH="$HOME/venv/bin:$PATH"  # marinrl venv' >> "$HOME/.bashrc"
"$HOME/venv/bin/python" -m pip install --quiet -c "$repo/constraints.txt" -e "$repo" "$jax"
# A GCP head node creates the other nodes through Google's API client.
[ "$accelerator" != cpu ] || "$HOME/venv/bin/python" -m pip install --quiet google-api-python-client
# TPU hosts of a multi-host slice only see their chips together (jax.distributed): no device check there.
check='import jax, marinrl; print("marinrl with jax", jax.__version__)'
[ "$accelerator" != cuda12 ] || check="$check; print(jax.devices('gpu'))"
"$HOME/venv/bin/python" -c "$check"
