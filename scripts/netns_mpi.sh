#!/usr/bin/env bash
# Two "machines" on this one: network namespaces ne-a (10.200.0.1) and ne-b (10.200.0.2) joined by a veth
# pair, then `mpiexec -hosts 10.200.0.1,10.200.0.2` runs a 2-rank job across them over TCP, and everything
# is torn down again (also on error or Ctrl-C). Needs root (ip netns) and the dist extra in .venv.
#
#   sudo scripts/netns_mpi.sh                      # a 2-rank allreduce check + 8 steps of nanoeuler train
#   sudo scripts/netns_mpi.sh -- train small --steps 4 --out runs/netns   # any nanoeuler command
#   sudo scripts/netns_mpi.sh --run .venv/bin/python bench/ddp.py --worker big --steps 3   # any program
#
# Hydra (MPICH's mpiexec) normally starts its proxy on a remote host with ssh; here its "ssh" is
# scripts/netns_launch.sh, which runs the proxy inside the namespace that owns the host's address
# (`-launcher ssh -launcher-exec`). mpiexec itself runs in ne-a, so every connection (the proxies' and
# the ranks') crosses the veth pair as TCP; the only addresses used are the project's own 10.200.0.0/24.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-$ROOT/.venv}
A=ne-a B=ne-b
IP_A=10.200.0.1 IP_B=10.200.0.2

cleanup() {
    ip netns del $A 2>/dev/null || true       # deleting a namespace deletes its end of the veth pair (and the pair)
    ip netns del $B 2>/dev/null || true
}
trap cleanup EXIT INT TERM
cleanup

ip netns add $A
ip netns add $B
ip link add ne-veth-a type veth peer name ne-veth-b
ip link set ne-veth-a netns $A
ip link set ne-veth-b netns $B
ip -n $A addr add $IP_A/24 dev ne-veth-a
ip -n $B addr add $IP_B/24 dev ne-veth-b
for ns in $A $B; do
    ip -n $ns link set lo up
done
ip -n $A link set ne-veth-a up
ip -n $B link set ne-veth-b up
echo "namespaces: $A ($IP_A) <-veth-> $B ($IP_B)"
ip -n $A -br addr show ne-veth-a; ip -n $B -br addr show ne-veth-b

# MPI between the namespaces: TCP through libfabric (no shared memory between "machines")
export FI_PROVIDER=tcp MPIR_CVAR_CH4_NETMOD=ofi MPIR_CVAR_NOLOCAL=1
export NETNS_MAP="$IP_A=$A,$IP_B=$B"
MPI=(ip netns exec $A env FI_PROVIDER=tcp MPIR_CVAR_CH4_NETMOD=ofi MPIR_CVAR_NOLOCAL=1 NETNS_MAP="$NETNS_MAP"
     "$VENV/bin/mpiexec" -hosts $IP_A,$IP_B -launcher ssh -launcher-exec "$ROOT/scripts/netns_launch.sh"
     -iface ne-veth-a -n 2 -ppn 1 -wdir "$ROOT")

echo "== 1. where each rank runs, and a sum across them"
"${MPI[@]}" "$VENV/bin/python" -c '
import socket, subprocess
from mpi4py import MPI
import numpy as np
c = MPI.COMM_WORLD
addr = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout.split()[3]
x = np.full(4, c.rank + 1.0)
y = np.empty(4)
c.Allreduce(x, y)
print(f"rank {c.rank} of {c.size}: address {addr}, allreduce of rank+1 -> {y[0]:g}", flush=True)
' | sort
echo "== 2. nanoeuler data-parallel training across the two namespaces"
if [ "${1:-}" = "--" ]; then
    shift
    "${MPI[@]}" "$VENV/bin/nanoeuler" "$@"
elif [ "${1:-}" = "--run" ]; then          # any program, e.g. --run .venv/bin/python bench/ddp.py --worker big --steps 3
    shift
    "${MPI[@]}" "$@"
else
    # the bundled corpus's tokenizer and shards, made once (if missing) before the ranks start
    "$VENV/bin/python" -c "from nanoeuler.cli.train import ensure_bundled_data; ensure_bundled_data(512, progress=False)"
    rm -rf /tmp/nanoeuler-netns-run
    "${MPI[@]}" "$VENV/bin/nanoeuler" train small --steps 8 --batch-size 8 --eval-every 8 --eval-batches 2 \
        --out /tmp/nanoeuler-netns-run --no-progress
fi
echo "== done; tearing down $A and $B"
