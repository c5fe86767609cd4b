#!/usr/bin/env bash
# Converts a target (and its draft) into engines/<name>-ckpt and builds the portable engine engines/<name>;
# with trtllm-build on PATH also engines/<name>-trtllm. <name> = target name + -medusa/-eagle/-eagle3/
# -draft/-ngram. `make build-engines` runs it with the Makefile's variables:
#
#   TARGET    smollm2, a Hugging Face folder or a .gguf file
#   DRAFT     empty (plain), medusa:PATH, eagle:PATH, eagle3:PATH, draft-model:PATH, ngram or ngram:K
#   DTYPE     the checkpoint's dtype (float32, float16, bfloat16)
#   ENGINES   the output folder (default engines)
#   SPECPIPE  the specpipe command (default: specpipe on PATH)
#   EAGLE_CONVERT_FLAGS, EAGLE3_CONVERT_FLAGS   extra `specpipe convert` flags for those drafts
#   EAGLE_BUILD_FLAGS, EAGLE3_BUILD_FLAGS       extra `specpipe build` flags (the Makefile picks them by DEVICE)
#
# Exits 2 for a DRAFT it does not know or one without its path.
set -euo pipefail

USAGE_EXIT=2
TARGET="${TARGET:-smollm2}"
DRAFT="${DRAFT-}"
DTYPE="${DTYPE:-float32}"
ENGINES="${ENGINES:-engines}"
read -r -a specpipe <<< "${SPECPIPE:-specpipe}"
read -r -a eagle_convert <<< "${EAGLE_CONVERT_FLAGS-}"
read -r -a eagle3_convert <<< "${EAGLE3_CONVERT_FLAGS-}"
read -r -a eagle_build <<< "${EAGLE_BUILD_FLAGS-}"
read -r -a eagle3_build <<< "${EAGLE3_BUILD_FLAGS-}"

name=$(basename "$TARGET")
name=${name%.gguf}
kind=${DRAFT%%:*}
arg=""
[[ "$DRAFT" == *:* ]] && arg=${DRAFT#*:}
conv=()
build=()
suffix=""
case "$kind" in
  "") ;;
  medusa) conv=(--medusa "$arg"); suffix=-medusa ;;
  eagle) conv=(--eagle "$arg" "${eagle_convert[@]}"); build=("${eagle_build[@]}"); suffix=-eagle ;;
  eagle3) conv=(--eagle3 "$arg" "${eagle3_convert[@]}"); build=("${eagle3_build[@]}"); suffix=-eagle3 ;;
  draft-model) conv=(--draft-model "$arg"); suffix=-draft ;;
  ngram) build=(--speculative ngram ${arg:+--ngram-k "$arg"}); suffix=-ngram ;;
  *) echo "DRAFT=$DRAFT: unknown; use medusa:PATH, eagle:PATH, eagle3:PATH, draft-model:PATH, ngram or ngram:K" >&2
     exit "$USAGE_EXIT" ;;
esac
if [[ ${#conv[@]} -gt 0 && -z "$arg" ]]; then
  echo "DRAFT=$DRAFT: give the draft's path, e.g. DRAFT=$kind:PATH" >&2
  exit "$USAGE_EXIT"
fi

# n-gram drafting needs no draft weights: it builds from the plain checkpoint.
ckpt_suffix=$suffix
[[ $kind == ngram ]] && ckpt_suffix=""
ckpt=$ENGINES/$name$ckpt_suffix-ckpt
"${specpipe[@]}" convert --target "$TARGET" --output "$ckpt" --dtype "$DTYPE" "${conv[@]}"
"${specpipe[@]}" build --checkpoint "$ckpt" --output "$ENGINES/$name$suffix" --backend portable "${build[@]}"
if command -v trtllm-build >/dev/null; then
  if [[ $kind == eagle3 ]]; then
    echo "note: EAGLE-3 has no TensorRT engine in TensorRT-LLM 1.2; skipping the trtllm build"
  else
    "${specpipe[@]}" build --checkpoint "$ckpt" --output "$ENGINES/$name$suffix-trtllm" --backend trtllm "${build[@]}"
  fi
else
  echo "note: trtllm-build not on PATH; built the portable engine only"
fi
