#!/usr/bin/env bash
# Hydra's "ssh" for scripts/netns_mpi.sh: called as  netns_launch.sh [ssh options] HOST COMMAND...,
# it runs COMMAND inside the network namespace that owns HOST's address (NETNS_MAP="ip=ns,ip=ns").
set -euo pipefail
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done   # drop ssh options such as -x
host=$1; shift
ns=""
IFS=, read -ra pairs <<< "${NETNS_MAP:?NETNS_MAP not set}"
for p in "${pairs[@]}"; do
    [ "${p%%=*}" = "$host" ] && ns=${p#*=}
done
[ -n "$ns" ] || { echo "netns_launch: no namespace for host $host" >&2; exit 1; }
exec ip netns exec "$ns" sh -c "$*"
