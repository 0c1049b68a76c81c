#!/usr/bin/env bash
# stack_news.sh — says which packages of scripts/current-stack.txt have a newer release on
# PyPI than the one pinned there: the versions people will run next, which CI does not
# yet check. A notice only; exit 0 either way.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
while IFS='=' read -r name _ pinned; do
  [[ -z "$name" || "$name" == \#* || -z "$pinned" ]] && continue
  newest=$(python3 -m pip index versions "$name" 2>/dev/null | sed -n 's/^[^(]*(\([^)]*\)).*/\1/p' | head -1)
  if [[ -n "$newest" && "$newest" != "$pinned" ]]; then
    echo "stack_news: $name $newest is on PyPI; vramscope is checked against $pinned (scripts/current-stack.txt)"
  fi
done < <(grep -E '^[A-Za-z0-9_.-]+==' "$root/scripts/current-stack.txt")
exit 0
