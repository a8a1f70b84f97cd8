#!/bin/sh
# Renders the example snippets in this directory from units/ and example-config.toml.
# The URL and sha512 are the example's: use your published image's (make sysext prints them).
set -eu
cd "$(dirname "$0")/.."
URL=https://downloads.example.com/gpunode/gpunode-0.1.0-x86-64.raw
SHA512=$(printf 'example' | sha512sum | cut -d' ' -f1)
render() {
    .venv/bin/gpunode --log-format json ignition --format "$1" --sysext-url "$URL" \
        --sysext-sha512 "$SHA512" --agent-config ignition/example-config.toml > "ignition/$2"
}
render butane gpunode.butane
render ignition gpunode.ign
render clc gpunode.clc
render cluster-azure cluster-azure-values.yaml
render cluster-aws cluster-aws-values.yaml
render cluster-secret gpunode-secret.yaml
