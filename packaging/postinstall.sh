#!/bin/sh
# Create the neuron user, and tell systemd about the units (without starting anything: the operator does).
set -e
if command -v systemd-sysusers >/dev/null 2>&1; then
    systemd-sysusers neuron.conf
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
