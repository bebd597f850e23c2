#!/bin/sh
# Stop the server before its files go; on an upgrade the running one keeps going until restarted.
set -e
if [ -d /run/systemd/system ] && { [ "$1" = "remove" ] || [ "$1" = "0" ]; }; then
    systemctl stop neuron.service neuron.socket || true
    systemctl disable neuron.service neuron.socket || true
fi
