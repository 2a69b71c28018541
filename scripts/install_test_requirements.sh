#!/usr/bin/env bash
# What the tests need besides Python packages: the etcd server that Paddle's elastic launcher uses as its
# rendezvous (tests/test_elastic.py starts one; Debian's etcd-server package), then requirements-test.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v etcd > /dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q etcd-server > /dev/null || { apt-get update -q > /dev/null && apt-get install -y -q etcd-server > /dev/null; }
fi
pip install -q -r requirements-test.txt
