#!/usr/bin/env bash
# Whether some disk space is free where an install is about to write.
#
#   scripts/check_disk.sh GB WHAT PATH [PATH ...]
#
# Exits 0 when the filesystem of every PATH has at least GB gibibytes free. Otherwise it
# names each PATH that falls short, how much is free there and what needs the space (WHAT),
# and exits 1, so that an install stops before it starts rather than halfway through with
# "No space left on device".
set -euo pipefail

if [ $# -lt 3 ]; then
    echo "usage: $0 GB WHAT PATH [PATH ...]" >&2
    exit 2
fi
need_gb=$1
what=$2
shift 2

short=0
seen=" "
for path in "$@"; do
    read -r free_kb mount < <(df -Pk "$path" | awk 'NR == 2 { print $4, $6 }')
    case "$seen" in *" $mount "*) continue ;; esac  # one line per filesystem
    seen="$seen$mount "
    free_gb=$((free_kb / 1048576))
    if [ "$free_gb" -lt "$need_gb" ]; then
        echo "check_disk: $what needs about $need_gb GiB free on the disk of $path;" \
            "$free_gb GiB is free there. Free some space, or point the install elsewhere." >&2
        short=1
    fi
done
exit $short
