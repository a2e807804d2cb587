#!/usr/bin/env bash
# Whether the chunk kernels of the working tree compute exactly what those of a revision do: the
# host harness (tests/kernels/chunk_kernels.cpp on tests/kernels/emulation.h) built from both, with
# float32 and with TF32 operands, run with --dump at each shape, and every file the revision
# writes (inputs and outputs) compared byte for byte with the tree's. A kernel change that only
# moves data (staging, tiling, occupancy) should leave every output bit-identical.
#
#   scripts/kernels_bit_identity.sh REV ["N BH C DK DV" ...]
#
# Prints one line per shape and operand kind, and exits non-zero if any file differs.
set -euo pipefail
rev=${1:?usage: scripts/kernels_bit_identity.sh REV [\"N BH C DK DV\" ...]}
shift
shapes=("$@")
# The last two have value widths that are not a multiple of 4: their tiles take the synchronous
# staging where the others are copied asynchronously.
[ ${#shapes[@]} -gt 0 ] || shapes=("3 2 64 64 128" "2 3 32 48 40" "2 1 64 256 64" "1 2 16 16 20" \
  "2 2 64 96 72" "1 2 64 24 40" "1 2 64 128 40" "1 2 64 32 18" "2 2 40 48 30")
root=$(git rev-parse --show-toplevel)
cxx=${CXX:-c++}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/rev"
git -C "$root" archive "$rev" tests/kernels src/ops/cuda | tar -x -C "$work/rev"
build() { # source root, output, extra flags
  "$cxx" -std=c++20 -O2 -pthread -Wno-unknown-pragmas -I "$1/tests/kernels/include" "$1/tests/kernels/chunk_kernels.cpp" \
    -o "$2" "${@:3}"
}
for kind in f32 tf32; do
  flags=()
  [ $kind = tf32 ] && flags=(-DEMULATE_TF32)
  build "$work/rev" "$work/old_$kind" "${flags[@]}" &
  build "$root" "$work/new_$kind" "${flags[@]}"
  wait
done
status=0
for kind in f32 tf32; do
  for s in "${shapes[@]}"; do
    d=$work/$kind/${s// /_}
    mkdir -p "$d/old" "$d/new"
    # shellcheck disable=SC2086
    "$work/old_$kind" $s --dump "$d/old" > /dev/null
    # shellcheck disable=SC2086
    "$work/new_$kind" $s --dump "$d/new" > /dev/null
    differ=()
    for f in "$d/old"/*; do
      cmp -s "$f" "$d/new/$(basename "$f")" || differ+=("$(basename "$f")")
    done
    if [ ${#differ[@]} -eq 0 ]; then
      echo "$kind [$s]: $(ls "$d/old" | wc -l) files identical"
    else
      echo "$kind [$s]: DIFFER ${differ[*]}"
      status=1
    fi
  done
done
exit $status
