#!/usr/bin/env bash
# Serving overhead on a bare GPU machine: our engine in-process vs through the bundled tritonserver.
#
#   build/gpu_serving.sh install-a                  # call A: client wheels (numpy 1.26.4, tritonclient, deps)
#   build/gpu_serving.sh run ENGINE_DIR [ARGS...]   # call B: nvidia-pytriton, the server venv, the benchmark
#
# ARGS go to `python -m pipeline.bench.serving` (e.g. --prompts FILE --num-prompts 16 --max-tokens 256);
# results land in $OUT/serving (serving-<gpu>.json, tritonserver.log). `run` also does install-a when its
# wheels are present, so one call works on a fresh machine. Safe to repeat: wheel sets already installed
# are skipped, the venv is reused, its .pth is rewritten.
#
# Why a venv: this Triton's Python-backend stub misreads BYTES tensors under numpy 2 and ignores
# PYTHONPATH, so the server runs from a venv whose .pth puts $SITE (numpy 1.26.4, tritonclient, pytriton)
# ahead of the image's site-packages (torch, transformers) and adds this repository.
#
# On the H200 image, its transformers 5.17 imports
# scikit-learn from its generation utilities when it is installed, and the image's scikit-learn and
# SciPy are built for numpy 2 (they read numpy.ulong at import), so under numpy 1.26 `from
# transformers import AutoTokenizer` fails. The .pth below hides both from this venv (a None entry in
# sys.modules makes importlib.util.find_spec answer None, so transformers treats them as absent);
# nothing the engine or the Triton models use needs them. Under numpy 2 instead, the stub misreads
# BYTES inputs (reproduced on the CPU) and returned an empty output tensor for our INT32-only engine
# model (seen on the H200), so numpy 1.26 it is. The image already has grpcio, protobuf and requests.
set -euo pipefail

PY=${PY:-python3}                     # the image's Python (torch, transformers)
SITE=${SITE:-/tmp/serving-site}       # wheels from the carried folders; not /tmp/site, where a bench
                                      # finds gguf: numpy 1.26 there breaks the image's transformers
TV=${TV:-/tmp/tv}                     # the venv tritonserver and the benchmark run in
WHL_A=${WHL_A:-.device/whl_a}
WHL_B=${WHL_B:-.device/whl_b}
OUT=${OUT:-/tmp/serving-out}
REPO=$(pwd)

# Install a folder of wheels into $SITE unless that exact set is installed already.
install_wheels() {
  local dir=$1 stamp
  compgen -G "$dir/*.whl" >/dev/null || { echo "no wheels in $dir: carry it"; exit 2; }
  stamp="$SITE/.installed-$(basename "$dir")"
  if [[ -f $stamp ]] && diff -q <(ls "$dir"/*.whl | xargs -n1 basename) "$stamp" >/dev/null; then
    echo "wheels of $dir already in $SITE"; return
  fi
  mkdir -p "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$dir"/*.whl
  ls "$dir"/*.whl | xargs -n1 basename >"$stamp"
  echo "installed $(wc -l <"$stamp") wheels of $dir into $SITE"
}

make_venv() {
  [[ -x $TV/bin/python3 ]] || "$PY" -m venv --without-pip "$TV"
  local image_site venv_site
  image_site=$("$PY" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  venv_site=$("$TV/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$SITE" "$REPO" "$image_site" >"$venv_site/specpipe-serving.pth"
  # The image's scikit-learn and SciPy need numpy 2; hide them (see the header) so transformers imports.
  rm -f "$venv_site/specpipe-numpy-long.pth"  # an earlier, insufficient workaround
  printf '%s\n' 'import sys; sys.modules.setdefault("sklearn", None); sys.modules.setdefault("scipy", None)' \
    >"$venv_site/specpipe-hide-numpy2-only.pth"
  # pytriton is located, not imported: its client half needs gevent, which the image lacks.
  "$TV/bin/python3" -c 'import importlib.util, numpy, torch, tritonclient.grpc, pipeline
assert numpy.__version__.startswith("1."), numpy.__version__
assert importlib.util.find_spec("pytriton"), "nvidia-pytriton missing"
from transformers import AutoTokenizer
print("venv ok: numpy", numpy.__version__, "torch", torch.__version__)'
}

case ${1:-} in
  install-a)
    install_wheels "$WHL_A"
    ;;
  run)
    engine=${2:?usage: $0 run ENGINE_DIR [ARGS...]}
    shift 2
    if compgen -G "$WHL_A/*.whl" >/dev/null; then install_wheels "$WHL_A"; fi
    [[ -f $SITE/.installed-$(basename "$WHL_A") ]] || { echo "run install-a first (no $WHL_A wheels installed)"; exit 2; }
    if compgen -G "$WHL_B/*.whl" >/dev/null; then install_wheels "$WHL_B"; fi
    [[ -d $SITE/pytriton ]] || { echo "no nvidia-pytriton in $SITE: carry $WHL_B"; exit 2; }
    make_venv
    export PATH="$TV/bin:$PATH"
    mkdir -p "$OUT/serving"
    python3 -m pipeline.bench.serving --engine "$engine" --device "${DEVICE:-cuda}" --output "$OUT/serving" "$@"
    ;;
  *)
    sed -n '2,10p' "$0"; exit 2
    ;;
esac
