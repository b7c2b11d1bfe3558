# shellcheck shell=bash
# Sourced by scripts/deploy.sh (which defines OUT_DIR, GPU_CLASS and die first).
#
# The settings of the last deploy.
# `make deploy` options persist per GPU class. After a successful deploy, the user-facing ones
# are saved: the stack's in $OUT_DIR/deploy.env (GPU_INSTANCE_TYPE, MONITORING, and RELEASE: the
# release a plain `make deploy` acts on), each release's job and chart settings in
# $OUT_DIR/releases/<release>.env. The next deploy reuses each one it is not given, and says so;
# one given again replaces it, one given empty (STEPS=) drops it: its default applies. "Given"
# means present in the environment, empty or not (deploy.mk passes on only what make was given).
STACK_SETTINGS=(GPU_INSTANCE_TYPE MONITORING RELEASE)
RELEASE_SETTINGS=(MODEL DATA OUTPUT STEPS TRAIN_CONFIG CHART_VALUES IMAGE)
SETTINGS_FILE="$OUT_DIR/deploy.env"
REUSED=()          # "KEY=value" of each setting taken from a settings file
REUSED_FROM=()     # the files they came from
declare -A GIVEN=() # the user-level value of each setting (given or reused), before defaults

release_settings_file() {
  echo "$OUT_DIR/releases/$1.env"
}

# Set each variable among KEYS that is not set now from FILE's KEY='value' lines (save_settings
# writes them). Strict: only those keys, one a line, the value single-quoted with a ' inside as
# '\''; anything else stops the script. The file is parsed, never sourced or eval'd.
load_settings() {
  local file="$1" line key value number=0
  local pattern="^([A-Z_]+)='(([^']|'\\\\'')*)'\$"
  shift
  [[ -f "$file" ]] || return 0
  while IFS= read -r line || [[ -n "$line" ]]; do
    number=$((number + 1))
    [[ -z "$line" || "$line" == "#"* ]] && continue
    [[ "$line" =~ $pattern ]] \
      || die "$file:$number is not KEY='value': fix it, or delete the file (it holds only the last deploy's settings)"
    key="${BASH_REMATCH[1]}"
    value="${BASH_REMATCH[2]//\'\\\'\'/\'}"
    [[ " $* " == *" $key "* ]] || die "$file:$number: $key is not one of the settings kept there ($*)"
    if [[ -z "${!key+set}" ]]; then
      printf -v "$key" '%s' "$value"
      REUSED+=("$key=$value")
      [[ " ${REUSED_FROM[*]} " == *" $file "* ]] || REUSED_FROM+=("$file")
    fi
  done <"$file"
}

# Write FILE with the non-empty user-level values of KEYS (atomically: a temp file renamed).
write_settings() {
  local file="$1" key
  shift
  mkdir -p "$(dirname "$file")"
  {
    echo "# The settings of the last successful \`make deploy GPU_CLASS=$GPU_CLASS\` (scripts/deploy.sh"
    echo "# writes this file): the next deploy reuses each one it is not given. Give one again to"
    echo "# change it, or empty (STEPS=) to drop it; deleting the file forgets them all."
    for key in "$@"; do
      if [[ -n "${GIVEN[$key]}" ]]; then
        printf "%s='%s'\n" "$key" "${GIVEN[$key]//\'/\'\\\'\'}"
      fi
    done
  } >"$file.tmp"
  mv "$file.tmp" "$file"
}

save_settings() {
  write_settings "$SETTINGS_FILE" "${STACK_SETTINGS[@]}"
  write_settings "$(release_settings_file "$RELEASE")" "${RELEASE_SETTINGS[@]}"
}

# One line: which settings came from the last deploy, and how to change or drop one.
print_reused_settings() {
  ((${#REUSED[@]} > 0)) || return 0
  local shown=() setting
  for setting in "${REUSED[@]}"; do shown+=("${setting%%=*}=$(printf '%q' "${setting#*=}")"); done
  echo "Settings from the last deploy (${REUSED_FROM[*]}): ${shown[*]} (give one again to change it, or empty, e.g. ${REUSED[0]%%=*}=, to drop it)"
}
