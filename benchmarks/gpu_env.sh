# Sourced by the GPU scripts: make autoshard importable on an offline CUDA machine.
#
# 1. installs the carried wheelhouse .whl/ (scripts/build_wheelhouse.py) into $SITE, except
#    autoshard's own wheel (once: a stamp file in $SITE lists what was installed);
# 2. builds a symlink shim $SHIM/autoshard that maps passes/ kernels/ search/ runtime/ into the
#    autoshard package the way pyproject.toml's package-dir does, so the working tree is used
#    without a build and without network;
# 3. exports PYTHONPATH.
# Needs ROOT (the repository root) and PYTHON; SITE and SHIM default to /tmp/site, /tmp/autoshard_src.
SITE="${SITE:-/tmp/site}"
SHIM="${SHIM:-/tmp/autoshard_src}"
if [[ -d "$ROOT/.whl" ]]; then
  mapfile -t WHEELS < <(find -L "$ROOT/.whl" -maxdepth 1 -type f -name '*.whl' ! -name 'autoshard-*.whl' | sort)
  # A stamp of the wheel names skips the reinstall when a later script of the same session
  # sources this file again (gpu_session.sh, then gpu_run.sh): ~30 s each time otherwise.
  STAMP="$(printf '%s\n' "${WHEELS[@]##*/}")"
  if [[ ${#WHEELS[@]} -gt 0 && "$(cat "$SITE/.autoshard_wheels" 2>/dev/null)" != "$STAMP" ]]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$SITE" "${WHEELS[@]}" \
      && printf '%s\n' "$STAMP" > "$SITE/.autoshard_wheels"
  fi
else
  echo "gpu_run.sh: no .whl/ wheelhouse in $ROOT; using the packages already installed" >&2
fi

# The shim: $SHIM/autoshard holds links to autoshard/* plus the four stage folders.
rm -rf "$SHIM"
mkdir -p "$SHIM/autoshard"
for entry in "$ROOT"/autoshard/*; do
  [[ "$(basename "$entry")" == "__pycache__" ]] || ln -s "$entry" "$SHIM/autoshard/"
done
for stage in passes kernels search runtime; do
  ln -s "$ROOT/$stage" "$SHIM/autoshard/$stage"
done
export PYTHONPATH="$SHIM:$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# `python -m`/`-c` put the working directory first on sys.path, where the repository's own
# autoshard/ (without the stage folders) would shadow the shim: keep it off.
export PYTHONSAFEPATH=1

model_spec() {  # model_spec FAMILY:SIZE[:ATTN]: sets MODEL, TAG (e.g. llama1.3b) and MODEL_ARGS for run.py;
  # FAMILY:SIZE is a reference spec or one of the Hugging Face zoo (hf-qwen2:1.5b, benchmarks/hf_zoo.py: no ATTN)
  local family size attn cal   # (--model, --attn when given, --calibration when CAL_DIR, default .cal, has the file)
  IFS=: read -r family size attn <<< "$1"
  MODEL="$family:$size"; TAG="$family$size"
  # a family ending in a digit keeps its size apart: hf-qwen2:1.5b → hf-qwen2_1.5b
  [[ $family == *[0-9] ]] && TAG="${family}_$size"
  MODEL_ARGS=(--model "$MODEL")
  [[ -n ${attn:-} ]] && MODEL_ARGS+=(--attn "$attn")
  cal="${CAL_DIR:-.cal}/${family}_${size}.json"
  [[ -f $cal ]] && MODEL_ARGS+=(--calibration "$cal")
  return 0
}
