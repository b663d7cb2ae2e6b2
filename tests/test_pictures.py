"""Honest pictures: a fixed S_w 1.0-1.5 colour scale with the job's own range stated, labels
with enough decimals to tell cells apart and only where they fit, heatmaps that bin a large
job without losing its worst worker, per-step charts with real axes that break where steps
were not sampled. What a browser draws is checked in tests/test_report_browser.py."""

from __future__ import annotations

import io
import itertools
import re

import numpy as np
import pytest

from lagscope.dashboards.colour_scale import colour_scale
from lagscope.dashboards.heatmap import draw_worker_heatmap
from lagscope.dashboards.heatmap_views import heatmap_view
from lagscope.dashboards.report import heatmap_svg, line_svg
from lagscope.dashboards.step_chart import line_view
from lagscope.dashboards.worker_grid import bin_workers
from tests.conftest import analyzed_reference


def test_se_is_drawn_on_the_fixed_scale_with_its_own_range_stated() -> None:
    """SE is slow everywhere (S_w 1.118-1.204): on a scale stretched from its lowest to its
    highest cell, its least slow worker read white and its slowest dark red. On the fixed
    scale no cell is darker than halfway, and the job's range is named."""
    worker_slowdown = analyzed_reference("SE")[1].worker_slowdown
    svg = heatmap_svg(worker_slowdown)
    low, high = float(worker_slowdown.min()), float(worker_slowdown.max())
    assert "colour scale fixed at S_w 1.0 (palest) to 1.5 (darkest)" in svg
    assert f"this job&#39;s S_w: {low:.3f} to {high:.3f}" in svg
    scale = colour_scale(worker_slowdown)
    assert scale.position(high) == pytest.approx((high - 1.0) / 0.5)
    assert scale.position(high) < 0.5 and scale.position(low) > 0.2
    # The legend marks the job's range on the colour bar.
    assert f"this job: {low:.3f} to {high:.3f}" in svg


def test_labels_have_the_decimals_the_jobs_range_needs() -> None:
    assert colour_scale(np.array([1.118, 1.151, 1.204])).label(1.1512) == "1.151"
    assert colour_scale(np.array([1.0, 1.9])).label(1.1512) == "1.15"


def test_a_healthy_job_is_not_drawn_red() -> None:
    scale = colour_scale(np.array([1.001, 1.002, 1.003]))
    assert scale.position(1.003) < 0.01


def test_a_cell_is_labelled_only_where_its_label_fits() -> None:
    """SE's 32 DP ranks leave 26 px a cell in 900 px: too narrow for '1.151', so the
    cells carry no text and the table of the top workers gives the values."""
    worker_slowdown = analyzed_reference("SE")[1].worker_slowdown
    view = heatmap_view(worker_slowdown)
    cells = view["chart"]["cells"]
    assert all(c["text"] is None for c in cells)
    assert len(view["top_workers"]) == 10
    assert view["top_workers"][0]["value"] == f"{worker_slowdown.max():.3f}"
    # Eight DP ranks leave room: every cell is labelled, no table.
    small = heatmap_view(worker_slowdown[:, :8])
    assert all(c["text"] is not None for c in small["chart"]["cells"])
    assert small["top_workers"] == []


def test_binning_keeps_the_worst_worker_of_each_bin() -> None:
    rng = np.random.default_rng(3)
    worker_slowdown = 1.0 + 0.01 * rng.random((8, 1562))
    worker_slowdown[3, 1041] = 1.4
    grid = bin_workers(worker_slowdown, max_columns=69, max_rows=64)
    assert grid.values.shape == (8, 68) and grid.dp_per_bin == 23
    column = 1041 // 23
    assert grid.values[3, column] == 1.4
    assert (grid.worst_dp[3, column], grid.worst_stage[3, column]) == (1041, 3)
    # Every bin's value is its block's maximum.
    for c in (0, 17, 67):
        first, last = grid.dp_span(c)
        assert grid.values[:, c].tolist() == worker_slowdown[:, first : last + 1].max(1).tolist()
    assert grid.dp_span(67) == (1541, 1561)


def test_a_100k_gpu_heatmap_is_binned_and_drills_down_to_every_worker() -> None:
    """dp 1562 x pp 8 (99,968 GPUs at tp 8): 68 columns of 23 DP ranks, the straggler's
    column linking to its group's own heatmap, where its cell is outlined."""
    rng = np.random.default_rng(4)
    worker_slowdown = 1.0 + 0.02 * rng.random((8, 1562))
    worker_slowdown[3, 1041] = 1.3
    view = heatmap_view(worker_slowdown, [(1041, 3)], drill_down=True)
    chart = view["chart"]
    assert view["binned"] and len(chart["cells"]) == 8 * 68
    assert chart["width"] <= 900
    verified = [c for c in chart["cells"] if c["kind"] == "verified"]
    assert len(verified) == 1 and verified[0]["value"] == "1.300000"
    target = verified[0]["href"].removeprefix("#")
    group = next(g for g in view["groups"] if g["chart"]["id"] == target)
    cell = next(c for c in group["chart"]["cells"] if c["kind"] == "verified")
    assert cell["title"] == "dp 1041, pp 3: S_w = 1.3000 (verified)"
    assert sum(len(g["chart"]["cells"]) for g in view["groups"]) == worker_slowdown.size
    # The worst DP replicas at full resolution, the verified one first.
    assert view["worst"]["ticks"][0]["text"] == "1041"
    assert view["top_workers"][0] == {
        "dp": 1041, "stage": 3, "value": "1.30", "kind": "verified", "machine": "",
    }  # fmt: skip


@pytest.mark.slow  # draws heatmaps of many job sizes (~11 s)
def test_png_heatmap_text_never_overlaps_and_states_the_scale() -> None:
    """At 12,288 GPUs the old PNG wrote 1,536 cell labels and 192 ticks into 2,640 px."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(5)
    for n_dp in (8, 32, 192, 1562):
        worker_slowdown = 1.0 + 0.1 * rng.random((8, n_dp))
        drawn: list = []
        original_close = plt.close
        plt.close = drawn.append  # keep the figure to measure its text
        try:
            draw_worker_heatmap(worker_slowdown, io.BytesIO(), title="t")
        finally:
            plt.close = original_close
        figure = drawn[0]
        renderer = figure.canvas.get_renderer()
        texts = [
            t for t in figure.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()
        ]
        boxes = [t.get_window_extent(renderer) for t in texts]
        for i, a in enumerate(boxes):
            for j in range(i + 1, len(boxes)):
                assert not a.overlaps(boxes[j]), (n_dp, texts[i].get_text(), texts[j].get_text())
        title = figure.axes[0].get_title()
        low, high = worker_slowdown.min(), worker_slowdown.max()
        assert "colour scale fixed at S_w 1.0 (palest) to 1.5 (darkest)" in title
        assert f"this job's S_w: {low:.3f} to {high:.3f}" in title
        assert figure.get_size_inches()[0] <= 24
        original_close(figure)


def test_the_per_step_chart_breaks_where_steps_were_not_sampled() -> None:
    steps = [*range(100, 110), *range(200, 210)]
    values = [1.1] * 10 + [1.2] * 10
    values[3] = float("nan")
    svg = line_svg(steps, values, [])
    runs = re.findall(r'<polyline class="step-run" points="([^"]+)"', svg)
    assert [len(run.split()) for run in runs] == [3, 6, 10]


def test_se_step_axis_is_cut_between_its_bursts_and_ticked_in_each() -> None:
    """SE samples steps 16-39, 403-437 and 808-838: to scale, three slivers on an axis of
    822 steps with a label at each end; cut, each burst its share, round ticks in each."""
    prepared, result = analyzed_reference("SE")
    steps = [int(s) for s in prepared.steps]
    view = line_view(steps, [float(v) for v in result.step_slowdown], [])
    assert len(view["cuts"]) == 2
    ticks = [(float(t["x"]), int(t["label"])) for t in view["step_ticks"]]
    assert [x for x, _ in ticks] == sorted(x for x, _ in ticks)
    assert [s for _, s in ticks] == sorted(s for _, s in ticks)
    for first, last in ((16, 39), (403, 437), (808, 838)):
        inside = [s for _, s in ticks if first <= s <= last]
        assert len(inside) >= 3, (first, ticks)
    # Value ticks are round numbers spanning the data.
    labels = [float(t["label"]) for t in view["value_ticks"]]
    steps_between = {round(b - a, 6) for a, b in itertools.pairwise(labels)}
    assert len(steps_between) == 1 and 4 <= len(labels) <= 8
    assert labels[0] <= 1.0 and labels[-1] >= float(np.nanmax(result.step_slowdown))


def test_a_long_run_is_thinned_without_losing_its_spike() -> None:
    steps = list(range(20_000))
    values = [1.05] * 20_000
    values[12_345] = 1.9
    view = line_view(steps, values, [])
    points = [tuple(map(float, p.split(","))) for p in view["runs"][0].split()]
    assert len(points) <= 4 * 900
    (low, y_low), (high, y_high) = [
        (float(t["label"]), float(t["y"]))
        for t in (view["value_ticks"][0], view["value_ticks"][-1])
    ]
    spike_y = y_low + (1.9 - low) / (high - low) * (y_high - y_low)
    assert min(y for _, y in points) == pytest.approx(spike_y, abs=0.1)
    labels = [int(t["label"]) for t in view["step_ticks"]]
    assert 4 <= len(labels) <= 20 and len({b - a for a, b in itertools.pairwise(labels)}) == 1


def test_heatmap_outlines_verified_workers_and_marks_their_crossings() -> None:
    """A straggler at (dp 1, pp 1) and a heavier stage 2: (dp 1, pp 2) scores highest
    without being slow itself."""
    worker_slowdown = np.array([[1.0, 1.0, 1.0], [1.0, 1.3, 1.0], [1.1, 1.4, 1.1]])
    svg = heatmap_svg(worker_slowdown, [(1, 1)])
    cells = re.findall(r'data-kind="(\w+)"[^>]*><title>dp (\d), pp (\d)', svg)
    kinds = {(int(dp), int(pp)): kind for kind, dp, pp in cells}
    assert kinds[1, 1] == "verified" and kinds[1, 2] == "crossing"
    assert kinds[0, 1] == "crossing"  # the verified worker's stage
    assert kinds[0, 0] == "unverified" and kinds[2, 2] == "unverified"


def _others(values: list[float]) -> str:
    """The others' figures written out here, not by the code under test."""
    return f"S {min(values):.3f}-{max(values):.3f}, median {float(np.median(values)):.3f}"


def test_a_ranked_list_says_where_the_groups_it_leaves_out_lie() -> None:
    """SE's top 5 DP ranks (1.186-1.204) read alone as five slow ranks; beside the other
    27 (1.118-1.184) they read as the top of one spread. At 1,560 DP ranks a straggler's
    rank stood above four arbitrary ones of 1,559 near-equal ranks, and the report's "by
    op type" left 3 of 11 op types out without a word."""
    from lagscope.dashboards.report import ReportData, render_report
    from lagscope.simulator.diagnose import diagnose
    from lagscope.simulator.summary import summary_lines

    prepared, result = analyzed_reference("SE")
    by_dp = sorted(result.by_dp_rank.overall.values(), reverse=True)
    scores = sorted(result.worker_slowdown.ravel().tolist(), reverse=True)
    lines = summary_lines(result)
    dp_line = next(line for line in lines if line.startswith("by DP rank"))
    assert f"(the other 27 DP ranks: {_others(by_dp[5:])})" in dp_line
    score_line = next(line for line in lines if line.startswith("worker score S_w"))
    assert f"(the other 61 workers: {_others(scores[3:])})".replace(" S ", " S_w ") in score_line
    stage_line = next(line for line in lines if line.startswith("by stage"))
    assert "the other" not in stage_line  # both stages are listed

    html = render_report(ReportData(title="SE", subtitle="", result=result,
                                    diagnosis=diagnose(result, prepared)))  # fmt: skip
    assert "<h3>by DP rank (top 8 of 32)</h3>" in html
    assert f'id="by-dp-others">the other 24 DP ranks: {_others(by_dp[8:])}</p>' in html
    assert "<h3>by stage</h3>" in html and 'id="by-stage-others"' not in html
    n_optypes = len(result.by_optype.overall)
    assert n_optypes > 8 and f"<h3>by op type (top 8 of {n_optypes})</h3>" in html


def test_the_top_workers_table_says_where_the_others_lie() -> None:
    """At 99,968 GPUs the table names 10 workers of 12,496 and the worst replicas' heatmap
    16 of 1,562 replicas: each says where the others lie, so near-equal scores are not
    read as ten stragglers."""
    rng = np.random.default_rng(4)
    worker_slowdown = 1.0 + 0.02 * rng.random((8, 1562))
    worker_slowdown[3, 1041] = 1.3
    view = heatmap_view(worker_slowdown, [(1041, 3)])
    shown = {(w["stage"], w["dp"]) for w in view["top_workers"]}
    others = [float(v) for (stage, dp), v in np.ndenumerate(worker_slowdown)
              if (stage, dp) not in shown]  # fmt: skip
    assert len(others) == worker_slowdown.size - len(shown)
    expected = f"the other {len(others):,} workers: {_others(others)}".replace(" S ", " S_w ")
    assert view["top_others"] == expected
    # The worst replicas' heatmap, against the other replicas' worst workers.
    shown_replicas = {int(tick["text"]) for tick in view["worst"]["ticks"]}
    rest = [float(worker_slowdown[:, dp].max()) for dp in range(1562) if dp not in shown_replicas]
    assert view["worst_others"] == (
        f"the other {len(rest):,} DP replicas: {_others(rest)}".replace(
            " S ", " worst worker's S_w "
        )
    )
