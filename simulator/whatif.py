"""What-if analysis: how fast would the steps have been without stragglers, and who is to
blame (docs/whatif.md §5-§6).

Every question is a *variant* of the step's inputs: the measured costs with some rows set
to their ideal values, or the ideal costs with some rows restored to what was measured.
All variants of an analysis are laid side by side as columns and simulated together by the
timeline engine. A variant whose background is the ideal needs only the DP ranks it
changes plus one representative ideal rank (all ideal ranks behave identically), which
makes the per-DP-rank attribution linear rather than quadratic in the DP size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.defaults import DEFAULT_DECOMPOSE_THRESHOLD
from lagscope.simulator.engine import CompiledModel, Timeline, simulate
from lagscope.simulator.prepare import DroppedStep, PreparedTrace

#: Share of workers that M_W blames: the top 3 %.
TOP_WORKER_SHARE = 0.03
#: A step whose own measured durations, replayed without launch delays, miss its measured
#: time by more than this share is not trusted (the stragglers paper's 5 % check).
TRUSTED_DISCREPANCY = 0.05
#: (node x column) cells simulated per engine pass: each float64 buffer of the pass is at
#: most 8 bytes x this, which bounds memory whatever the job's size.
DEFAULT_MAX_CELLS_PER_PASS = 1_500_000


@dataclass(frozen=True)
class Selection:
    """Rows of the trace: ops whose node is in `nodes`, on workers in `workers`."""

    nodes: np.ndarray  # bool [node]
    workers: np.ndarray  # bool [stage, dp]


@dataclass(frozen=True)
class Variant:
    """Inputs of one simulation.

    cost: measured everywhere ("measured"), ideal everywhere ("ideal"), and `swap` rows take
    the other one. delay: none, all measured launch delays, or only those of `swap`.
    """

    cost: Literal["measured", "ideal"]
    swap: Selection | None = None
    delay: Literal["none", "all", "swap"] = "none"


@dataclass(frozen=True)
class Explained:
    """explain(X): how much of the slowdown removing / adding rows X accounts for."""

    workers: tuple[tuple[int, int], ...]  # (dp, stage)
    t_original: float
    t_ideal: float
    t_removed: float
    t_added: float

    @property
    def removed_share(self) -> float:
        return _share(self.t_original - self.t_removed, self.t_original - self.t_ideal)

    @property
    def added_share(self) -> float:
        return _share(self.t_added - self.t_ideal, self.t_original - self.t_ideal)


def _share(part: float, whole: float) -> float:
    return part / whole if whole != 0 else float("nan")


@dataclass(frozen=True)
class Attribution:
    """Slowdown with only group X straggling: S_X overall and per step."""

    overall: dict[str, float]
    per_step: dict[str, np.ndarray]

    def ranked(self) -> list[tuple[str, float]]:
        return sorted(self.overall.items(), key=lambda kv: -kv[1])


@dataclass(frozen=True)
class WhatIfResult:
    """The what-if analysis of a trace's steps: their actual, simulated and ideal times
    and what each group of ops, ranks and stages costs."""

    steps: np.ndarray
    #: Measured step time (max end - min start of the step's rows).
    t_actual: np.ndarray
    #: Simulated with measured costs and launch delays (must reproduce t_actual).
    t_simulated: np.ndarray
    #: Simulated with measured costs, no launch delays (T_nd).
    t_nodelay: np.ndarray
    #: Simulated with ideal costs (T_id).
    t_ideal: np.ndarray
    slowdown: float
    launch_slowdown: float
    by_optype: Attribution
    by_dp_rank: Attribution
    by_stage: Attribution
    launch_by_optype: Attribution | None
    launch_by_dp_rank: Attribution | None
    launch_by_stage: Attribution | None
    #: S_w = min(S_dp, S_stage), [stage, dp].
    worker_slowdown: np.ndarray
    #: None when the analysis was run without `explain` (per-step streaming results).
    mw: Explained | None
    ms: Explained | None
    decompose_threshold: float
    ideal_cost: dict[str, float]
    dropped_steps: tuple[DroppedStep, ...] = field(default=())

    @property
    def waste(self) -> float:
        """Share of the step's time lost to stragglers: 1 - 1/S."""
        return 1.0 - 1.0 / self.slowdown

    @property
    def step_slowdown(self) -> np.ndarray:
        return self.t_nodelay / self.t_ideal

    @property
    def launch_step_slowdown(self) -> np.ndarray:
        return self.t_actual / self.t_nodelay

    @property
    def decomposed(self) -> bool:
        return self.slowdown >= self.decompose_threshold

    @property
    def discrepancy(self) -> np.ndarray:
        """Per step: |T_nd - T_actual| / T_actual, how far the step's own measured
        durations replayed through the dependency model (no launch delays) miss its
        measured time. Large when the model lacks a dependency the job has (time the
        replay cannot place) or has one the job lacks (waits the job never made)."""
        return np.abs(self.t_nodelay - self.t_actual) / self.t_actual

    @property
    def trusted(self) -> np.ndarray:
        """Per step: the replay reproduces the step within `TRUSTED_DISCREPANCY`."""
        return self.discrepancy <= TRUSTED_DISCREPANCY

    @property
    def simulation_error(self) -> float:
        """Largest |simulated - measured| step time (s): how well the model fits."""
        return float(np.max(np.abs(self.t_simulated - self.t_actual)))


def ideal_costs(prepared: PreparedTrace) -> dict[str, float]:
    """Ideal cost per op type: mean duration of compute ops, median cost of comm ops.

    Pooled over every stage, step and rank of the trace (docs/whatif.md §5): the ideal is the
    average worker, and stage imbalance counts as straggling.
    """
    result: dict[str, float] = {}
    node_optype = np.array(prepared.node_optype)
    for optype in sorted(set(node_optype.tolist())):
        nodes = np.flatnonzero(node_optype == optype)
        if ot.is_compute(optype):
            result[optype] = float(prepared.duration[nodes].mean(dtype=np.float64))
        else:
            result[optype] = float(np.median(prepared.cost[nodes]))
    return result


_Cells = tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]


def _swap_in(
    target: np.ndarray,
    source: np.ndarray,
    cells: _Cells,
    measured: Callable[..., np.ndarray],
) -> None:
    """`target`'s swapped `cells` (rows, columns or a mask: `WhatIfAnalysis._swapped_cells`)
    from `source`: values [row, step, dp], read as the pass' columns by `measured`, or the
    ideal ([row, column] or [row, 1])."""
    rows, cols, mask = cells
    if source.ndim == 3:
        if rows is not None:
            target[rows] = measured(source, rows)
            return
        source = measured(source)
    elif rows is not None:
        target[rows] = source[rows]
        return
    source = np.broadcast_to(source, target.shape)
    if cols is not None:
        target[:, cols] = source[:, cols]
    else:
        np.copyto(target, source, where=mask)


class WhatIfAnalysis:
    """Runs variants of one prepared trace through the engine."""

    def __init__(
        self,
        prepared: PreparedTrace,
        ideal: dict[str, float] | None = None,
        *,
        compiled: CompiledModel | None = None,
        max_cells_per_pass: int = DEFAULT_MAX_CELLS_PER_PASS,
        step_ideals: Sequence[dict[str, float]] | None = None,
    ):
        """`ideal` holds for every step; `step_ideals` (one per step) replaces it when each
        step has its own ideal costs (a stream's running estimates)."""
        self.prepared = prepared
        self.compiled = compiled or prepared.model.compiled
        if step_ideals is not None:
            if ideal is not None:
                raise ValueError("give either ideal or step_ideals, not both")
            if len(step_ideals) != prepared.n_steps:
                raise ValueError(
                    f"step_ideals has {len(step_ideals)} entries for {prepared.n_steps} steps"
                )
            self.step_ideals: list[dict[str, float]] | None = list(step_ideals)
            self.ideal = self.step_ideals[0]
            # [node, step]: a column of the engine takes its step's ideal.
            names, node_index = np.unique(np.array(prepared.node_optype), return_inverse=True)
            by_step = np.array(
                [[ideals[name] for name in names.tolist()] for ideals in self.step_ideals],
                dtype=np.float64,
            ).reshape(prepared.n_steps, names.size)
            self.ideal_node_cost = np.ascontiguousarray(by_step[:, node_index].T)
        else:
            self.step_ideals = None
            self.ideal = ideal if ideal is not None else ideal_costs(prepared)
            # [node, 1]: the same ideal for every column.
            self.ideal_node_cost = np.array(
                [self.ideal[t] for t in prepared.node_optype], dtype=np.float64
            )[:, None]
        self.node_stage = prepared.model.node_stage()
        self.max_cells_per_pass = max_cells_per_pass
        self._repeated_ideals: dict[int, np.ndarray] = {}

    # -- selections -------------------------------------------------------------------
    def all_workers(self) -> np.ndarray:
        return np.ones((self.prepared.n_stages, self.prepared.n_dp), dtype=bool)

    def all_nodes(self) -> np.ndarray:
        return np.ones(self.prepared.model.n_nodes, dtype=bool)

    def nodes_labelled(self, labels: list[str] | np.ndarray, label: str) -> Selection:
        return Selection(np.asarray(labels) == label, self.all_workers())

    def stage_rows(self, stage: int) -> Selection:
        workers = np.zeros_like(self.all_workers())
        workers[stage, :] = True
        return Selection(self.all_nodes(), workers)

    def dp_rows(self, dp: int) -> Selection:
        workers = np.zeros_like(self.all_workers())
        workers[:, dp] = True
        return Selection(self.all_nodes(), workers)

    def worker_rows(self, workers: Iterable[tuple[int, int]]) -> Selection:
        mask = np.zeros_like(self.all_workers())
        for dp, stage in workers:
            mask[stage, dp] = True
        return Selection(self.all_nodes(), mask)

    def ideal_timeline(self) -> Timeline:
        """Start and end of every op in the ideal step (the same for every DP rank)."""
        if self.step_ideals is not None:
            raise ValueError("the ideal timeline needs one ideal for all steps")
        cost = self.ideal_node_cost.copy()
        result = simulate(self.compiled, cost, None, np.zeros(1, np.int64), record_timeline=True)
        assert result.timeline is not None
        return result.timeline

    # -- running variants -------------------------------------------------------------
    def _columns(self, variant: Variant) -> np.ndarray:
        """DP ranks a variant must simulate: all, or the changed ones plus one ideal."""
        n_dp = self.prepared.n_dp
        if variant.cost == "measured" or variant.delay == "all":
            return np.arange(n_dp)
        if variant.swap is None:
            return np.arange(1)
        # The stages of the swapped nodes, then their workers: the same as asking every
        # node's stage row, without a [node, dp] array per variant (one per DP rank).
        stages = np.zeros(self.prepared.n_stages, dtype=bool)
        stages[self.node_stage[variant.swap.nodes]] = True
        touched = variant.swap.workers[stages].any(axis=0)
        changed = np.flatnonzero(touched)
        untouched = np.flatnonzero(~touched)
        return np.concatenate([changed, untouched[:1]]) if untouched.size else changed

    # The pass' buffers are in the engine's row order (`simulate`'s `in_engine_order`): the
    # trace's values are read in that order once per analysis, not once per variant.
    @cached_property
    def _cost_rows(self) -> np.ndarray:
        """The measured costs, [row, step, dp] in the engine's order."""
        return np.take(self.prepared.cost, self.compiled.order, axis=0)

    @cached_property
    def _delay_rows(self) -> np.ndarray:
        """The measured launch delays, [row, step, dp] in the engine's order."""
        return np.take(self.prepared.launch_delay, self.compiled.order, axis=0)

    @cached_property
    def _ideal_rows(self) -> np.ndarray:
        """The ideal costs, [row, step] (or [row, 1]) in the engine's order."""
        return np.take(self.ideal_node_cost, self.compiled.order, axis=0)

    def _ideal_columns(self, n_dp_cols: int) -> np.ndarray:
        """The ideal costs of a pass slice of `n_dp_cols` DP ranks a step ([row, column],
        or [row, 1] when every step shares one ideal)."""
        ideal = self._ideal_rows
        if ideal.shape[1] == 1:
            return ideal
        cached = self._repeated_ideals.get(n_dp_cols)
        if cached is None:
            cached = self._repeated_ideals[n_dp_cols] = np.repeat(ideal, n_dp_cols, axis=1)
        return cached

    def _fill(
        self, variant: Variant, dp_cols: np.ndarray, cost: np.ndarray, delay: np.ndarray | None
    ) -> None:
        """Write a variant's inputs into its slice of a pass's buffers ([row, column], rows
        in the engine's order)."""
        prep = self.prepared
        n_steps = cost.shape[1] // dp_cols.size
        all_dp = dp_cols.size == prep.n_dp and np.array_equal(dp_cols, np.arange(prep.n_dp))

        def measured(values: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
            """`values` [row, step, dp] as the pass' [row, column] (of `rows` only)."""
            if rows is not None:
                values = values[rows]
            if all_dp:
                return values.reshape(values.shape[0], -1)  # columns are (step, dp) in order
            return values[:, :, dp_cols].reshape(values.shape[0], -1)

        ideal = self._ideal_columns(dp_cols.size)
        if variant.cost == "measured":
            cost[:] = measured(self._cost_rows)
        else:
            cost[:] = ideal
        if variant.swap is None:
            if delay is not None:
                delay[:] = measured(self._delay_rows) if variant.delay == "all" else 0.0
            return
        # The swapped cells: whole rows (op types, stages), whole columns (DP ranks), or
        # (top workers) a mask of both.
        cells = self._swapped_cells(variant.swap, np.tile(dp_cols, n_steps))
        if variant.delay != "swap":
            source = ideal if variant.cost == "measured" else self._cost_rows
            _swap_in(cost, source, cells, measured)
        if delay is not None:
            if variant.delay == "all":
                delay[:] = measured(self._delay_rows)
            else:
                delay[:] = 0.0
                if variant.delay == "swap":
                    _swap_in(delay, self._delay_rows, cells, measured)

    def _swapped_cells(self, swap: Selection, col_dp: np.ndarray) -> _Cells:
        """(rows, None, None) when `swap` holds whole stages' workers, (None, columns, None)
        when it holds every node of whole DP ranks, else (None, None, [row, column] mask):
        a row or column copy instead of a masked copy of the whole pass. Rows are the
        engine's."""
        workers = swap.workers
        whole_stages = workers.all(axis=1)
        if np.array_equal(workers, np.broadcast_to(whole_stages[:, None], workers.shape)):
            nodes = np.flatnonzero(swap.nodes & whole_stages[self.node_stage])
            return np.sort(self.compiled.row_of_node[nodes]), None, None
        whole_dp = workers.all(axis=0)
        if swap.nodes.all() and np.array_equal(
            workers, np.broadcast_to(whole_dp[None, :], workers.shape)
        ):
            return None, np.flatnonzero(whole_dp[col_dp]), None
        mask = swap.nodes[:, None] & workers[:, col_dp][self.node_stage]
        return None, None, mask[self.compiled.order]

    def run(self, variants: list[Variant]) -> list[np.ndarray]:
        """Step time of every variant, [step] each.

        Variants are packed into passes of at most `max_cells_per_pass` (node x column)
        cells; variants with launch delays share passes so the others need no delay buffer.
        """
        prep = self.prepared
        n_nodes = prep.model.n_nodes
        plans = []
        for index, variant in enumerate(variants):
            dp_cols = self._columns(variant)
            pure_ideal = variant.cost == "ideal" and variant.swap is None
            same_every_step = pure_ideal and variant.delay == "none" and self.step_ideals is None
            steps_simulated = 1 if same_every_step else prep.n_steps
            plans.append((index, variant, dp_cols, steps_simulated))
        plans.sort(key=lambda plan: plan[1].delay != "none")

        results: list[np.ndarray] = [np.empty(0)] * len(variants)
        passes: list[list] = []
        cells = 0
        for plan in plans:
            width = plan[2].size * plan[3] * n_nodes
            with_delay = plan[1].delay != "none"
            if (
                not passes
                or cells + width > self.max_cells_per_pass
                or (passes[-1][0][1].delay != "none") != with_delay
            ):
                passes.append([])
                cells = 0
            passes[-1].append(plan)
            cells += width

        for group in passes:
            n_cols = sum(plan[2].size * plan[3] for plan in group)
            cost = np.empty((n_nodes, n_cols))
            delay = np.empty((n_nodes, n_cols)) if group[0][1].delay != "none" else None
            offsets: list[int] = []
            col = 0
            for _, variant, dp_cols, steps_simulated in group:
                width = dp_cols.size * steps_simulated
                part = slice(col, col + width)
                self._fill(
                    variant, dp_cols, cost[:, part], None if delay is None else delay[:, part]
                )
                offsets.extend(range(col, col + width, dp_cols.size))
                col += width
            times = simulate(
                self.compiled,
                cost,
                delay,
                np.array(offsets, dtype=np.int64),
                in_engine_order=True,
            )
            segment = 0
            for index, _, _, steps_simulated in group:
                step_time = times.step_time[segment : segment + steps_simulated]
                results[index] = np.broadcast_to(step_time, (prep.n_steps,)).copy()
                segment += steps_simulated
        return results


def analyze(
    prepared: PreparedTrace,
    *,
    ideal: dict[str, float] | None = None,
    decompose_threshold: float = DEFAULT_DECOMPOSE_THRESHOLD,
    max_cells_per_pass: int = DEFAULT_MAX_CELLS_PER_PASS,
    compiled: CompiledModel | None = None,
    explain: bool = True,
) -> WhatIfResult:
    """The full what-if analysis of a prepared trace (docs/whatif.md §6).

    Attributions are always computed (M_W needs them); `decomposed` tells whether the
    slowdown passed `decompose_threshold`, which reporting uses to gate them.
    """
    wa = WhatIfAnalysis(prepared, ideal, compiled=compiled, max_cells_per_pass=max_cells_per_pass)
    n_stages = prepared.n_stages
    attributions = _attribution_groups(wa)
    base = [Variant("measured"), Variant("ideal")]
    if explain:
        base.insert(0, Variant("measured", delay="all"))
    last_stage = wa.stage_rows(n_stages - 1)
    explain_stage = (
        [Variant("measured", swap=last_stage), Variant("ideal", swap=last_stage)] if explain else []
    )
    first_pass = base + [Variant("ideal", swap=sel) for _, _, sel in attributions] + explain_stage
    times = wa.run(first_pass)
    if explain:
        t_simulated, times = times[0], times[1:]
    t_nodelay, t_ideal = times[:2]
    if not explain:
        t_simulated = np.full_like(t_nodelay, np.nan)
    attr_times = times[2 : 2 + len(attributions)]

    t_actual = prepared.actual_step_time
    launch_groups: list[tuple[str, str, Selection]] = []
    launch_times: list[np.ndarray] = []
    if float(t_actual.mean() / t_nodelay.mean()) >= decompose_threshold:
        launch_groups = _launch_groups(wa)
        launch_times = wa.run(
            [Variant("measured", swap=sel, delay="swap") for _, _, sel in launch_groups]
        )
    result = _assemble(
        prepared,
        slice(None),
        wa.ideal,
        t_simulated,
        t_nodelay,
        t_ideal,
        (attributions, attr_times),
        (launch_groups, launch_times),
        decompose_threshold,
    )
    if not explain:
        return result

    return _explained(wa, result, *times[-2:])


def _explained(
    wa: WhatIfAnalysis, result: WhatIfResult, ms_removed: np.ndarray, ms_added: np.ndarray
) -> WhatIfResult:
    """`result` with M_W (its top workers at their measured / ideal times) and M_S (the
    last stage's, from `ms_removed` / `ms_added`, the first pass' last two variants)."""
    prepared = wa.prepared
    n_stages, n_dp = prepared.n_stages, prepared.n_dp
    t_orig, mean_ideal = float(result.t_nodelay.mean()), float(result.t_ideal.mean())
    top = top_workers(result.worker_slowdown, prepared.worker_rank)
    top_rows = wa.worker_rows(top)
    mw_removed, mw_added = wa.run(
        [Variant("measured", swap=top_rows), Variant("ideal", swap=top_rows)]
    )
    mw = Explained(top, t_orig, mean_ideal, float(mw_removed.mean()), float(mw_added.mean()))
    ms = Explained(
        tuple((dp, n_stages - 1) for dp in range(n_dp)),
        t_orig,
        mean_ideal,
        float(ms_removed.mean()),
        float(ms_added.mean()),
    )
    return replace(result, mw=mw, ms=ms)


def analyze_each_step(
    prepared: PreparedTrace,
    step_ideals: Sequence[dict[str, float]],
    *,
    decompose_threshold: float = DEFAULT_DECOMPOSE_THRESHOLD,
    max_cells_per_pass: int = DEFAULT_MAX_CELLS_PER_PASS,
    compiled: CompiledModel | None = None,
) -> list[WhatIfResult]:
    """Every step analysed on its own, with its own ideal costs, in one vectorized pass.

    Result i equals `analyze(prepared.select_steps([i]), ideal=step_ideals[i],
    explain=False)` bit for bit (the engine's columns never mix), so a stream may analyse
    a backlog of closed steps at once and still give the numbers of one step at a time.
    """
    wa = WhatIfAnalysis(
        prepared, compiled=compiled, max_cells_per_pass=max_cells_per_pass, step_ideals=step_ideals
    )
    attributions = _attribution_groups(wa)
    times = wa.run(
        [Variant("measured"), Variant("ideal")]
        + [Variant("ideal", swap=sel) for _, _, sel in attributions]
    )
    t_nodelay, t_ideal, attr_times = times[0], times[1], times[2:]
    t_simulated = np.full_like(t_nodelay, np.nan)
    # The launch attribution is gated per step, as a one-step analysis would gate it.
    gated = prepared.actual_step_time / t_nodelay >= decompose_threshold
    launch_groups: list[tuple[str, str, Selection]] = []
    launch_times: list[np.ndarray] = []
    if gated.any():
        launch_groups = _launch_groups(wa)
        launch_times = wa.run(
            [Variant("measured", swap=sel, delay="swap") for _, _, sel in launch_groups]
        )
    # One division per group for all steps, not one mean and one division per group and
    # step (a one-step slice's mean is its value, so the numbers are the same).
    attr_ratio = np.array(attr_times) / t_ideal
    launch_ratio = np.array(launch_times) / t_nodelay if launch_groups else None
    return [
        _result(
            prepared,
            slice(i, i + 1),
            step_ideals[i],
            (t_simulated, t_nodelay, t_ideal),
            _step_attributions(attributions, attr_ratio[:, i].copy()),
            _step_attributions(launch_groups, launch_ratio[:, i].copy())
            if gated[i] and launch_ratio is not None
            else None,
            decompose_threshold,
            dropped_steps=(),
        )
        for i in range(prepared.n_steps)
    ]


def each_step_of(
    whole: WhatIfResult,
    prepared: PreparedTrace,
    *,
    compiled: CompiledModel | None = None,
    max_cells_per_pass: int = DEFAULT_MAX_CELLS_PER_PASS,
) -> list[WhatIfResult]:
    """Every step's result as `analyze_each_step(prepared, [whole.ideal_cost] * n_steps)`
    gives it, bit for bit, read off `whole` (`analyze(prepared)`): its per-step times and
    attributions are those simulations already (the engine's columns never mix, and a
    one-step mean is its value). Only the launch attribution of steps that pass the gate
    while the whole trace did not is simulated again. A recorded trace is told step by
    step (`job_story.tell_trace`) without simulating every variant a second time.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> job = generate_job(JobSpec(dp=2, pp=2, steps=3))
    >>> prepared = prepare(job.trace, job.meta)
    >>> whole = analyze(prepared)
    >>> read = each_step_of(whole, prepared)
    >>> again = analyze_each_step(prepared, [whole.ideal_cost] * 3)
    >>> [(a.t_ideal == b.t_ideal).all() and a.slowdown == b.slowdown
    ...  for a, b in zip(read, again)]
    [True, True, True]
    """
    threshold = whole.decompose_threshold
    gated = prepared.actual_step_time / whole.t_nodelay >= threshold
    launch: dict[str, dict[str, np.ndarray]] | None = None
    if whole.launch_by_optype is not None:
        launch = {
            "optype": whole.launch_by_optype.per_step,
            "dp": whole.launch_by_dp_rank.per_step,  # type: ignore[union-attr]
            "stage": whole.launch_by_stage.per_step,  # type: ignore[union-attr]
        }
    elif gated.any():
        wa = WhatIfAnalysis(
            prepared, whole.ideal_cost, compiled=compiled, max_cells_per_pass=max_cells_per_pass
        )
        groups = _launch_groups(wa)
        times = wa.run([Variant("measured", swap=sel, delay="swap") for _, _, sel in groups])
        launch = {kind: {} for kind in ("optype", "dp", "stage")}
        for (kind, name, _), t in zip(groups, times, strict=True):
            launch[kind][name] = t / whole.t_nodelay
    by_kind = {
        "optype": whole.by_optype.per_step,
        "dp": whole.by_dp_rank.per_step,
        "stage": whole.by_stage.per_step,
    }
    t_simulated = np.full_like(whole.t_nodelay, np.nan)
    return [
        _result(
            prepared,
            slice(i, i + 1),
            whole.ideal_cost,
            (t_simulated, whole.t_nodelay, whole.t_ideal),
            _one_step(by_kind, i),
            _one_step(launch, i) if gated[i] and launch is not None else None,
            threshold,
            dropped_steps=(),
        )
        for i in range(prepared.n_steps)
    ]


def _one_step(per_step: dict[str, dict[str, np.ndarray]], i: int) -> dict[str, Attribution]:
    """Step `i`'s attributions, of every kind, from each group's per-step values."""
    out = {}
    for kind, groups in per_step.items():
        values = {name: ratios[i : i + 1].copy() for name, ratios in groups.items()}
        out[kind] = Attribution({n: float(v[0]) for n, v in values.items()}, values)
    return out


def _step_attributions(
    groups: list[tuple[str, str, Selection]], ratios: np.ndarray
) -> dict[str, Attribution]:
    """`_group_attributions` of one step, from each group's ratio to its baseline."""
    out = {kind: Attribution({}, {}) for kind in ("optype", "dp", "stage")}
    for (kind, name, _), value, position in zip(
        groups, ratios.tolist(), range(len(groups)), strict=True
    ):
        out[kind].overall[name] = value
        out[kind].per_step[name] = ratios[position : position + 1]
    return out


def _attribution_groups(wa: WhatIfAnalysis) -> list[tuple[str, str, Selection]]:
    """S_X groups: every merged op type, every DP rank, every stage."""
    prepared = wa.prepared
    labels = np.array([ot.report_label(t) for t in prepared.node_optype])
    return (
        [("optype", name, wa.nodes_labelled(labels, name)) for name in sorted(set(labels.tolist()))]
        + [("dp", str(dp), wa.dp_rows(dp)) for dp in range(prepared.n_dp)]
        + [("stage", str(s), wa.stage_rows(s)) for s in range(prepared.n_stages)]
    )


def _launch_groups(wa: WhatIfAnalysis) -> list[tuple[str, str, Selection]]:
    """Launch-delay attribution groups: as `_attribution_groups`, the first op its own type."""
    prepared = wa.prepared
    labels = _launch_labels(prepared, [ot.report_label(t) for t in prepared.node_optype])
    return (
        [("optype", n, wa.nodes_labelled(labels, n)) for n in sorted(set(labels))]
        + [("dp", str(dp), wa.dp_rows(dp)) for dp in range(prepared.n_dp)]
        + [("stage", str(s), wa.stage_rows(s)) for s in range(prepared.n_stages)]
    )


def _assemble(
    prepared: PreparedTrace,
    steps: slice,
    ideal: dict[str, float],
    t_simulated: np.ndarray,
    t_nodelay: np.ndarray,
    t_ideal: np.ndarray,
    attribution: tuple[list[tuple[str, str, Selection]], list[np.ndarray]],
    launch: tuple[list[tuple[str, str, Selection]], list[np.ndarray]],
    decompose_threshold: float,
    dropped_steps: tuple[DroppedStep, ...] | None = None,
) -> WhatIfResult:
    """The result over `steps` from simulated step times (mw/ms left to the caller)."""
    t_orig, mean_ideal = float(t_nodelay[steps].mean()), float(t_ideal[steps].mean())
    groups, times = attribution
    grouped = _group_attributions(groups, [t[steps] for t in times], mean_ideal, t_ideal[steps])
    launch_groups, launch_times = launch
    by_launch = (
        _group_attributions(
            launch_groups, [t[steps] for t in launch_times], t_orig, t_nodelay[steps]
        )
        if launch_groups
        else None
    )
    return _result(
        prepared,
        steps,
        ideal,
        (t_simulated, t_nodelay, t_ideal),
        grouped,
        by_launch,
        decompose_threshold,
        dropped_steps,
    )


def _result(
    prepared: PreparedTrace,
    steps: slice,
    ideal: dict[str, float],
    times: tuple[np.ndarray, np.ndarray, np.ndarray],
    grouped: dict[str, Attribution],
    by_launch: dict[str, Attribution] | None,
    decompose_threshold: float,
    dropped_steps: tuple[DroppedStep, ...] | None,
) -> WhatIfResult:
    """The result over `steps` (`times`: the simulated, no-delay and ideal step times of
    every step) with its attributions."""
    t_simulated, t_nodelay, t_ideal = (t[steps] for t in times)
    t_actual = prepared.actual_step_time[steps]
    s_dp = np.array([grouped["dp"].overall[str(dp)] for dp in range(prepared.n_dp)])
    s_stage = np.array([grouped["stage"].overall[str(s)] for s in range(prepared.n_stages)])
    return WhatIfResult(
        steps=prepared.steps[steps],
        t_actual=t_actual,
        t_simulated=t_simulated,
        t_nodelay=t_nodelay,
        t_ideal=t_ideal,
        slowdown=float(t_nodelay.mean()) / float(t_ideal.mean()),
        launch_slowdown=float(t_actual.mean() / t_nodelay.mean()),
        by_optype=grouped["optype"],
        by_dp_rank=grouped["dp"],
        by_stage=grouped["stage"],
        launch_by_optype=by_launch["optype"] if by_launch else None,
        launch_by_dp_rank=by_launch["dp"] if by_launch else None,
        launch_by_stage=by_launch["stage"] if by_launch else None,
        worker_slowdown=np.minimum(s_dp[None, :], s_stage[:, None]),
        mw=None,
        ms=None,
        decompose_threshold=decompose_threshold,
        ideal_cost=ideal,
        dropped_steps=prepared.dropped_steps if dropped_steps is None else dropped_steps,
    )


def top_workers(
    worker_slowdown: np.ndarray, worker_rank: np.ndarray
) -> tuple[tuple[int, int], ...]:
    """The top 3 % of (dp, stage) workers by S_w, ties broken by the lower global rank."""
    n_stages, n_dp = worker_slowdown.shape
    n_top = math.ceil(TOP_WORKER_SHARE * n_stages * n_dp)
    stage, dp = np.meshgrid(np.arange(n_stages), np.arange(n_dp), indexing="ij")
    order = np.lexsort((worker_rank.ravel(), -worker_slowdown.ravel()))[:n_top]
    return tuple((int(dp.ravel()[i]), int(stage.ravel()[i])) for i in order)


def _launch_labels(prepared: PreparedTrace, labels: list[str]) -> list[str]:
    """Optype labels for launch attribution: the pipeline's first op is its own label."""
    out = list(labels)
    for i, node in enumerate(prepared.model.nodes):
        first_compute = node.stage == 0 and node.optype == ot.FORWARD_COMPUTE and node.seq == 0
        first_recv = node.stage > 0 and node.optype == ot.FORWARD_RECV and node.seq == 0
        if first_compute or first_recv:
            out[i] = ot.FIRST_OP
    return out


def _group_attributions(
    groups: list[tuple[str, str, Selection]],
    times: list[np.ndarray],
    baseline_mean: float,
    baseline: np.ndarray,
) -> dict[str, Attribution]:
    out: dict[str, Attribution] = {}
    for kind in ("optype", "dp", "stage"):
        overall, per_step = {}, {}
        for (k, name, _), t in zip(groups, times, strict=True):
            if k == kind:
                overall[name] = float(t.mean()) / baseline_mean
                per_step[name] = t / baseline
        out[kind] = Attribution(overall, per_step)
    return out
