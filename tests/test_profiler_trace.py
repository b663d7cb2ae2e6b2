"""torch.profiler traces in: a real 4-process job (gloo, DP 2 x PP 2, 1F1B with real
send/recv and all-reduce) recorded by torch.profiler, read back and analysed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from lagscope.cli import main
from lagscope.producers.profiler_trace import load_profiler_traces
from lagscope.producers.reference_format import write_meta
from lagscope.simulator import optypes as ot
from lagscope.simulator.errors import TraceError
from lagscope.simulator.trace import JobMeta
from tests.torch_profiler.pipeline_job import DP, PP, record

STEPS = 4
MICROBATCHES = 4
#: (dp 1, stage 1): its forward takes twice as long.
SLOW_RANK = 3
META = JobMeta(trial_name="profiled", dp_size=DP, pp_size=PP, world_size=DP * PP)


# Recording the traces runs a real torch job under torch.profiler (~20 s), and reading
# them in full takes as long: every test that uses them is slow.
@pytest.fixture(scope="module")
def profiled_torch_job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profiler")
    record(out / "traces", steps=STEPS, microbatches=MICROBATCHES, slow_rank=SLOW_RANK)
    write_meta(META, out / "meta.yaml")
    return out


def test_the_reader_finds_every_worker_step_and_op_type(profiled_torch_job):
    trace, stats = load_profiler_traces([profiled_torch_job / "traces"], META)

    assert stats.files == DP * PP and stats.ranks_analysed == DP * PP
    # The profiler's warm-up step (0) is not recorded; the others all are.
    assert stats.steps == list(range(1, STEPS + 1))
    assert sorted(np.unique(trace.step).tolist()) == stats.steps
    workers = {(int(d), int(s)) for d, s in zip(trace.dp_rank, trace.stage, strict=True)}
    assert workers == {(d, s) for d in range(DP) for s in range(PP)}
    assert set(trace.optype_names) == {
        ot.FORWARD_COMPUTE,
        ot.BACKWARD_COMPUTE,
        ot.FORWARD_SEND,
        ot.FORWARD_RECV,
        ot.BACKWARD_SEND,
        ot.BACKWARD_RECV,
        ot.GRADS_REDUCE_SCATTER,
        ot.OPTIMIZER,
    }

    def count(optype: str, stage: int) -> int:
        code = trace.optype_names.index(optype)
        rows = (trace.optype == code) & (trace.stage == stage) & (trace.step == 1)
        return int(rows.sum()) // DP

    for stage in range(PP):
        assert count(ot.FORWARD_COMPUTE, stage) == MICROBATCHES
        assert count(ot.BACKWARD_COMPUTE, stage) == MICROBATCHES
        # Two weights and two biases: one gradient all-reduce each.
        assert count(ot.GRADS_REDUCE_SCATTER, stage) == 4
    # Activations flow from stage 0 to 1, gradients back.
    assert count(ot.FORWARD_SEND, 0) == count(ot.FORWARD_RECV, 1) == MICROBATCHES
    assert count(ot.BACKWARD_SEND, 1) == count(ot.BACKWARD_RECV, 0) == MICROBATCHES
    assert count(ot.FORWARD_RECV, 0) == count(ot.BACKWARD_SEND, 0) == 0


def test_analyze_names_the_slow_rank(profiled_torch_job, capsys):
    out = profiled_torch_job / "analysis.json"
    code = main(
        [
            "analyze",
            "--profiler-trace",
            str(profiled_torch_job / "traces"),
            "--meta",
            str(profiled_torch_job / "meta.yaml"),
            "--json",
            str(out),
            "--timeline",
            str(profiled_torch_job / "timeline.json"),
        ]
    )
    captured = capsys.readouterr()
    printed = captured.out
    assert code == 0, printed + captured.err  # the error is on stderr
    assert "4 torch.profiler trace(s), 4 worker(s), steps 1-4" in printed
    document = json.loads(out.read_text())
    assert document["slowdown"] > 1.2
    slowest = max(document["worker_slowdown"], key=lambda w: w["slowdown"])
    assert (slowest["dp"], slowest["stage"]) == (1, 1)
    assert document["mw"]["workers"] == [{"dp": 1, "stage": 1}]
    assert len(document["clock_offsets"]["workers"]) == DP * PP
    assert json.loads((profiled_torch_job / "timeline.json").read_text())["traceEvents"]


def test_a_directory_of_profiler_traces_alone_is_analysed_with_the_meta_beside_it(
    profiled_torch_job, tmp_path, capsys
):
    out = tmp_path / "analysis.json"

    code = main(["analyze", str(profiled_torch_job / "traces"), "--json", str(out)])

    printed = capsys.readouterr().out
    assert code == 0
    assert f"{profiled_torch_job / 'meta.yaml'}, found beside the trace" in printed
    assert "4 torch.profiler trace(s), 4 worker(s), steps 1-4" in printed
    assert json.loads(out.read_text())["mw"]["workers"] == [{"dp": 1, "stage": 1}]


def test_replay_turns_profiler_traces_into_rank_logs(profiled_torch_job, tmp_path):
    logs = tmp_path / "logs"
    code = main(
        [
            "replay",
            "--profiler-trace",
            *map(str, sorted((profiled_torch_job / "traces").iterdir())),
            "--meta",
            str(profiled_torch_job / "meta.yaml"),
            "--log-dir",
            str(logs),
            "--no-progress",
        ]
    )
    assert code == 0
    assert sorted(p.name for p in logs.iterdir() if p.is_dir()) == [
        f"rank-{rank:06d}" for rank in range(DP * PP)
    ]


def test_a_missing_rank_is_named(profiled_torch_job, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("rank0.pt.trace.json", "rank1.pt.trace.json", "rank2.pt.trace.json"):
        shutil.copy(profiled_torch_job / "traces" / name, partial / name)
    with pytest.raises(TraceError, match=r"4 \(dp, stage\) worker\(s\) but traces of 3"):
        load_profiler_traces([partial], META)


def test_a_trace_without_step_markers_says_how_to_record_them(profiled_torch_job, tmp_path):
    source = json.loads((profiled_torch_job / "traces" / "rank0.pt.trace.json").read_text())
    source["traceEvents"] = [
        e for e in source["traceEvents"] if not str(e.get("name", "")).startswith("ProfilerStep")
    ]
    bad = tmp_path / "rank0.json"
    bad.write_text(json.dumps(source))
    with pytest.raises(TraceError, match=r"rank0.json: no ProfilerStep#N markers.*schedule"):
        load_profiler_traces([bad], META)


def test_not_a_chrome_trace(tmp_path):
    bad = tmp_path / "rank0.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match=r"rank0.json: not a Chrome trace"):
        load_profiler_traces([bad], META)
    with pytest.raises(TraceError, match="no such file"):
        load_profiler_traces([tmp_path / "absent"], META)
