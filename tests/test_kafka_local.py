"""The local broker (`python -m lagscope.deploy.kafka_local start --data-dir DIR`) never
deletes what it did not make: a failed first start was retried on a wiped data directory,
the user's files in it and the logs its own error named included."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lagscope.deploy.kafka_local import KafkaBroker, KafkaLocalError

#: Two JVM starts that fail.
pytestmark = pytest.mark.slow


def test_a_failed_first_start_keeps_the_users_files_and_its_logs(tmp_path: Path) -> None:
    data_dir = tmp_path / "my-folder"
    data_dir.mkdir()
    (data_dir / "notes.txt").write_text("the user's own file")
    with socket.socket() as taken:  # the broker's port, held by someone else
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        broker = KafkaBroker(data_dir, port=taken.getsockname()[1])
        with pytest.raises(KafkaLocalError) as failed:
            broker.start(timeout_s=60)
    assert (data_dir / "notes.txt").read_text() == "the user's own file"
    message = str(failed.value)
    assert " / then: " in message  # retried once
    named = [data_dir / "server.log", data_dir / "broker.out"]
    assert any(str(path) in message for path in named), message
    assert all(path.exists() for path in named if str(path) in message)
    # What the failed start formatted is gone, so a later start formats afresh.
    assert not (data_dir / "kraft-logs" / "meta.properties").exists()
