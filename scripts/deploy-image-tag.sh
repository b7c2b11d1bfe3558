# shellcheck shell=bash
# Sourced by scripts/deploy.sh (which defines ROOT first): the image's tag.

# What the image is built from: the Dockerfile, its .dockerignore and the sources of the
# Dockerfile's COPY instructions (not COPY --from=<stage>), one a line.
build_inputs() {
  echo Dockerfile
  echo .dockerignore
  sed -e ':join' -e '/\\$/{N; s/\\\n/ /; b join' -e '}' Dockerfile \
    | awk 'toupper($1) == "COPY" {
        for (i = 2; i < NF; i++) { if ($i ~ /^--from/) next; if ($i !~ /^--/) print $i }
      }'
}

# The files of the build inputs in the working tree, tracked or not, less what .gitignore
# ignores, NUL-separated and sorted: what `docker build .` sends (.dockerignore allow-lists the
# same paths).
build_files() {
  local inputs=()
  mapfile -t inputs < <(build_inputs)
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard -- "${inputs[@]}" \
    | LC_ALL=C sort -zu \
    | while IFS= read -r -d '' file; do
      # a tracked file deleted from the working tree is not in the build context
      if [[ -f "$ROOT/$file" ]]; then printf '%s\0' "$file"; fi
    done
}

image_tag() {
  local tag inputs=()
  tag="$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null)" || {
    echo dev
    return
  }
  mapfile -t inputs < <(build_inputs)
  # ECR tags are immutable: a build context that differs from the commit (an edit, or a new file
  # not yet added: `docker build` sends it all the same) gets a tag of its own, named by a hash of
  # the context's file names and contents, so that redeploying the same tree finds the image in
  # ECR and any other edit builds anew.
  if [[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=all -- "${inputs[@]}")" ]]; then
    tag="$tag-dirty-$(cd "$ROOT" && build_files | xargs -0 -r sha256sum -- | sha256sum | cut -c1-12)"
  fi
  echo "$tag"
}
