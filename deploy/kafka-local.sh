#!/usr/bin/env bash
# Thin wrapper: run a local single-node Kafka (KRaft) without Docker. See deploy/kafka_local.py.
#   deploy/kafka-local.sh start --port 9092 --data-dir /tmp/lagscope-kafka
#   deploy/kafka-local.sh stop --data-dir /tmp/lagscope-kafka
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${root}/.venv/bin/python"
[ -x "$python" ] || python=python3
cd "$root"
exec "$python" -m lagscope.deploy.kafka_local "$@"
