#!/usr/bin/env bash
# Builds a scratch venv holding SGLang's tool-call detectors and reasoning parsers (the oracle of
# tests/profiles/test_sglang_differential.py, read by tools/sglang_oracle.py).
# SGLang's pins conflict with the project's, so it never goes into the project's venv: this venv
# sees the project's venv through a .pth line (reusing its CPU torch, transformers, numpy...) and
# adds sglang (--no-deps) and the few modules its import chain needs on top.
# Usage: sglang_oracle_venv.sh VENV_DIR BASE_PYTHON   (BASE_PYTHON: the project venv's python)
set -euo pipefail
venv="$1"
base_python="$2"
python3 -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$base_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/project-venv.pth"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --no-deps sglang==0.5.23
# what sglang's import chain needs and the project venv lacks; --no-deps keeps the project's
# torch/transformers (pip's resolver would otherwise reach for sglang's pins)
"${pip[@]}" --no-deps partial_json_parser pybase64 msgspec pyzmq psutil pillow starlette \
    requests aiohttp openai ipython traitlets sniffio triton xgrammar apache-tvm-ffi packaging tqdm 2>&1 | grep -v "dependency resolver" || true
