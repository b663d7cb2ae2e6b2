"""A what-if variant's inputs: whatever shape its swap has (whole op types or stages,
whole DP ranks, single workers), the engine gets what the definition says: every cell of
a swapped (node, worker) takes the other cost, and only those."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lagscope.simulator.generate import JobSpec, generate_job
from lagscope.simulator.prepare import prepare
from lagscope.simulator.whatif import Variant, WhatIfAnalysis, ideal_costs


@pytest.fixture(scope="module")
def analysis() -> WhatIfAnalysis:
    job = generate_job(JobSpec(dp=3, pp=2, microbatches=2, steps=3, seed=4))
    prepared = prepare(job.trace, job.meta)
    ideals = [ideal_costs(prepared.select_steps([i])) for i in range(prepared.n_steps)]
    return WhatIfAnalysis(prepared, step_ideals=ideals)


def _by_definition(wa: WhatIfAnalysis, variant: Variant, dp_cols: np.ndarray):
    """The variant's [node, column] cost and delay, cell by cell from the definition."""
    prep = wa.prepared
    n_nodes, n_steps = prep.model.n_nodes, prep.n_steps
    columns = [(step, dp) for step in range(n_steps) for dp in dp_cols]
    cost = np.empty((n_nodes, len(columns)))
    delay = np.empty((n_nodes, len(columns)))
    stage_of = wa.node_stage
    for node, (col, (step, dp)) in itertools.product(range(n_nodes), enumerate(columns)):
        swapped = variant.swap is not None and bool(
            variant.swap.nodes[node] and variant.swap.workers[stage_of[node], dp]
        )
        measured = prep.cost[node, step, dp]
        ideal = wa.ideal_node_cost[node, step]
        uses_measured = (variant.cost == "measured") != (swapped and variant.delay != "swap")
        cost[node, col] = measured if uses_measured else ideal
        own_delay = prep.launch_delay[node, step, dp]
        delay[node, col] = (
            own_delay if variant.delay == "all" or (variant.delay == "swap" and swapped) else 0.0
        )
    return cost, delay


def test_every_kind_of_swap_fills_the_cells_the_definition_says(analysis) -> None:
    wa = analysis
    prep = wa.prepared
    labels = np.array(prep.node_optype)
    selections = [
        None,
        wa.nodes_labelled(labels, labels[0]),  # an op type: whole rows
        wa.stage_rows(1),  # a stage: whole rows
        wa.dp_rows(2),  # a DP rank: whole columns
        wa.worker_rows([(1, 0)]),  # one worker: a mask
        wa.worker_rows([(0, 0), (0, 1)]),  # every stage of DP 0: whole columns
        wa.worker_rows([(0, 1), (1, 1), (2, 1)]),  # every DP rank of stage 1: whole rows
    ]
    for swap, cost_kind, delay_kind in itertools.product(
        selections, ("measured", "ideal"), ("none", "all", "swap")
    ):
        if swap is None and delay_kind == "swap":
            continue
        variant = Variant(cost_kind, swap=swap, delay=delay_kind)
        for dp_cols in (np.arange(prep.n_dp), np.array([2, 0])):
            width = dp_cols.size * prep.n_steps
            cost = np.full((prep.model.n_nodes, width), np.nan)
            delay = np.full((prep.model.n_nodes, width), np.nan)
            wa._fill(variant, dp_cols, cost, delay)
            want_cost, want_delay = _by_definition(wa, variant, dp_cols)
            # The pass' rows are in the engine's order.
            want_cost, want_delay = want_cost[wa.compiled.order], want_delay[wa.compiled.order]
            np.testing.assert_array_equal(cost, want_cost, err_msg=f"{variant} {dp_cols}")
            np.testing.assert_array_equal(delay, want_delay, err_msg=f"{variant} {dp_cols}")
