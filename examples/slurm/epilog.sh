#!/bin/sh
# SLURM Epilog for nodes that run jaxckpt: frees what the ended allocation's jaxckpt agents left in /dev/shm.
#
# slurmd runs the Epilog as root on every node of a job once its processes are gone, with SLURM_JOB_ID set.
# Install it and add to slurm.conf (then `scontrol reconfigure`):
#     Epilog=/etc/slurm/epilog.d/jaxckpt.sh
# (or call it from the Epilog you have). It is optional: an agent run as its own step frees its memory at the
# allocation's end, and the next jaxckpt agent of the same user on the node sweeps what an ended allocation
# left; this removes it at once, whatever ran. The default agent directory of a job under SLURM is
# /dev/shm/jaxckpt-<uid>-<job>@slurm<SLURM_JOB_ID>@<node> (docs/deploy.md); '@' ends the id, so job 12 never
# matches 123. A Config.shm_dir set by hand is the user's to remove. Where the site points Config.shm_root
# (JAXCKPT_SHM_ROOT) at a huge-page tmpfs of its own (docs/deploy.md, "Huge pages"), add that root to ROOTS.
set -eu
ROOTS="/dev/shm"
[ -n "${SLURM_JOB_ID:-}" ] || exit 0
case "$SLURM_JOB_ID" in *[!0-9]*) exit 0 ;; esac
for root in $ROOTS; do
    for d in "$root"/jaxckpt-*@slurm"$SLURM_JOB_ID"@*; do
        [ -d "$d" ] && [ ! -L "$d" ] && rm -rf -- "$d"
    done
done
exit 0
