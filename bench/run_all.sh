#!/usr/bin/env bash
# Builds the benchmarks (Release), runs them all one after the other, and rewrites their figures
# in docs/BENCHMARKS.md (the text between each benchmark's <!-- figures:NAME --> markers).
#
#   bench/run_all.sh            full run (a few minutes)
#   bench/run_all.sh --quick    short run, same tables with fewer samples
#
# Installs the Debian packages the peers need first (.ci/setup.sh --packages).
# BUILD_DIR overrides the build directory (default: build-bench at the top of the tree).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${BUILD_DIR:-$root/build-bench}
quick=()
case "${1:-}" in
  --quick) quick=(--quick) ;;
  "") ;;
  *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac

"$root/.ci/setup.sh" --packages  # the peers (iceoryx, gRPC) are Debian packages too
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
  -DBUBBLE_BUILD_TESTS=OFF -DBUBBLE_BUILD_EXAMPLES=OFF \
  -DBUBBLE_BUILD_DAEMON=OFF -DBUBBLE_BUILD_BINDINGS=OFF >/dev/null
cmake --build "$build" -j2 --target harvest_sim hot_path signal_latency memory

out=$build/bench/results
mkdir -p "$out"
cd "$build/bench"
for b in hot_path signal_latency memory; do
  echo "== $b ${quick[*]}" >&2
  ./"$b" "${quick[@]}" | tee "$out/$b.md" >&2
done
echo "== harvest_sim" >&2
{
  echo "- command: \`./harvest_sim\` (in the build directory's bench/)"
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo '```'
  ./harvest_sim
  echo '```'
} | tee "$out/harvest_sim.md" >&2

python3 - "$root/docs/BENCHMARKS.md" "$out" <<'PY'
import pathlib, re, sys
doc, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
text = doc.read_text()
for name in ("hot_path", "signal_latency", "memory", "harvest_sim"):
    figures = (out / f"{name}.md").read_text().strip()
    pattern = re.compile(rf"(<!-- figures:{name} -->\n)(.*?\n)?(<!-- /figures:{name} -->)", re.S)
    if not pattern.search(text):
        sys.exit(f"docs/BENCHMARKS.md has no <!-- figures:{name} --> markers")
    text = pattern.sub(lambda m: m.group(1) + figures + "\n" + m.group(3), text)
doc.write_text(text)
print(f"rewrote the figures in {doc}", file=sys.stderr)
PY
