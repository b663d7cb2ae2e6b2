"""A minimal RunsApp for tests: logs every run it gets, commits, exits at a record count.

Usage: python -m tests.fetch_runs_app BOOTSTRAP TOPIC GROUP DATA_DIR OUT_JSON N_RECORDS
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from faust.types import TP

from lagscope.stream_app.fetch_runs import PassThroughCodec, RunsApp, run_records


def main() -> None:
    bootstrap, topic_name, group, data_dir, out_path, n_records = sys.argv[1:7]
    app = RunsApp(
        group,
        run_topics=frozenset({topic_name}),
        broker=f"kafka://{bootstrap}",
        datadir=data_dir,
        web_enabled=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        consumer_max_fetch_size=16 * 1024,  # many small runs
    )
    topic = app.topic(
        topic_name, key_serializer="raw", value_serializer=PassThroughCodec(), acks=False
    )
    runs: list[dict] = []

    @app.agent(topic)
    async def collect(stream: Any) -> None:
        async for event in stream.events():
            records = run_records(event.message)
            runs.append(
                {
                    "partition": event.message.partition,
                    "run_offset": event.message.offset,
                    "offsets": [r.offset for r in records],
                    "values": [r.value.decode() for r in records],
                }
            )
            if sum(len(r["offsets"]) for r in runs) >= int(n_records):
                ends = {}
                for run in runs:
                    ends[run["partition"]] = max(ends.get(run["partition"], 0),
                                                 run["offsets"][-1] + 1)  # fmt: skip
                committed = await app.commit_offsets(
                    {TP(topic_name, p): end for p, end in ends.items()}
                )
                with open(out_path, "w") as out:
                    json.dump({"runs": runs, "committed": committed}, out)
                os.kill(os.getpid(), signal.SIGTERM)

    from faust.worker import Worker

    Worker(app, loglevel="WARNING").execute_from_commandline()


if __name__ == "__main__":
    main()
