"""THE verdict of an analysis, and how its numbers are written.

A job (or a slow episode of it) gets one verdict: one cause, one sentence, the workers or
the stage it names, and the action to take first. It is computed here, from the diagnosis
alone, and every output renders it (the summary of `lagscope analyze`, its JSON, the HTML
report, the demo's and `lagscope run`'s summaries): when each output built its own story
from the raw numbers, the summary said "move layers" while the diagnosis said sequence
imbalance and the escalation said re-split micro-batches. The diagnosis is the authority
because it checks the what-if numbers (M_W, M_S) against the job's own noise and verifies
workers one by one; M_W or M_S alone can point at a stage or workers that are not the cause.

Shares of the slowdown are written as shares (0-100 %) by `share`; the number underneath
can leave that range (a rem of 122 %: the rest of the job runs faster than the ideal mean),
and then it follows with the reason. Pure functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lagscope.simulator.causes import WORKER_CAUSES, Cause
from lagscope.simulator.evidence import Escalation

if TYPE_CHECKING:
    from lagscope.simulator.diagnose import Diagnosis

#: One sentence of meaning for each number a reader meets in the outputs.
MEANINGS: dict[str, str] = {
    "S": "step time over the step time without stragglers (1.0 = no loss)",
    "M_W": "share of the slowdown that goes away when the top 3% of workers (by S_w) run "
    "at ideal speed",
    "M_S": "share of the slowdown that goes away when the last pipeline stage runs at ideal speed",
    "S_w": "worker score, the smaller of the S of its DP replica and of its stage: high "
    "only where both are slow; a score, not a verdict",
}

#: Why a removed share (M_W, M_S, ...) can leave 0-100 %, by the side it leaves on.
ABOVE_100 = "above 100% because the rest of the job runs faster than the ideal mean"
BELOW_0 = (
    "below 0% because these rows' ideal, a mean raised by slower rows elsewhere, exceeds "
    "their own time"
)
#: Why a group's attribution S_X can exceed S itself.
ABOVE_S = "above S because the other groups, put at their ideal, run slower than they did"


def percent(value: float, digits: int = 0) -> str:
    """`value` (a fraction) as a percentage, never "-0%": a tiny negative reads 0%.

    >>> percent(0.1234, 1), percent(-0.0001), percent(-0.0012, 1)
    ('12.3%', '0%', '-0.1%')
    """
    text = f"{value * 100:.{digits}f}%"
    if text.startswith("-") and float(text[1:-1]) == 0:
        text = text[1:]
    return text


def share(value: float, name: str = "the raw share", digits: int = 0) -> str:
    """A share of the slowdown, clamped to 0-100 % so that it reads as a share; when the
    number underneath, written with the same digits, says something else, it follows in
    parentheses with the reason (a removed share is not bounded, docs/whatif.md §6.5).

    >>> share(0.688)
    '69%'
    >>> share(1.219, "M_S")
    '100% (M_S is 122%: above 100% because the rest of the job runs faster than the ideal mean)'
    >>> share(-0.0012), share(1.002), share(-0.0012, digits=1)
    ('0%', '100%', "0.0% (the raw share is -0.1%: below 0% because these rows' ideal, a mean raised by slower rows elsewhere, exceeds their own time)")
    """  # noqa: E501
    clamped = percent(min(max(value, 0.0), 1.0), digits)
    return clamped + raw_note(value, name, digits)


def raw_note(value: float, name: str = "the raw share", digits: int = 0) -> str:
    """What `share` adds after the clamped share: "" when the raw number reads the same,
    else " (NAME is RAW%: reason)"."""
    clamped = percent(min(max(value, 0.0), 1.0), digits)
    raw = percent(value, digits)
    if raw == clamped:
        return ""
    return f" ({name} is {raw}: {ABOVE_100 if value > 1 else BELOW_0})"


def of_the_slowdown(value: float, name: str = "the raw share", digits: int = 0) -> str:
    """ "N% of the slowdown" for a diagnosis' sentence, the share clamped as in `share` and
    the note on the number underneath at the end, where it does not cut the sentence.

    >>> of_the_slowdown(1.219, "M_S")
    '100% of the slowdown (M_S is 122%: above 100% because the rest of the job runs faster than the ideal mean)'
    """  # noqa: E501
    clamped = percent(min(max(value, 0.0), 1.0), digits)
    return f"{clamped} of the slowdown{raw_note(value, name, digits)}"


@dataclass(frozen=True)
class Verdict:
    """What every output says about one analysis (a job or one of its slow episodes)."""

    #: The diagnosis' cause.
    cause: Cause
    #: One sentence: what is wrong, with the share it explains.
    headline: str
    #: The (dp, stage) workers it names, if any.
    workers: tuple[tuple[int, int], ...] = ()
    #: The pipeline stage it names, if any.
    stage: int | None = None
    #: The first thing to do: the first fix of the escalation ladder ("ignore" when none).
    action: str = "ignore"
    #: The re-simulated speed-up of that action, when the diagnosis predicted one.
    predicted_speedup: float | None = None
    #: The step of the escalation ladder the loss so far has reached.
    now: str = "ignore"
    #: For a slow episode that is over: the step it recovered at (its action is for when
    #: it comes back, not for now).
    recovered_at: int | None = None

    def line(self) -> str:
        """The verdict in one line: "cause: headline".

        >>> Verdict(Cause.NONE, "no significant straggling").line()
        'none: no significant straggling'
        """
        return f"{self.cause}: {self.headline}"

    def action_line(self) -> str:
        """The action, its predicted speed-up when known, and the ladder's step when the
        loss so far has climbed past it (so that the escalation never reads as another
        story).

        >>> Verdict(Cause.SLOW_WORKERS, "y", action="balance sequence lengths", predicted_speedup=1.064).action_line()
        'balance sequence lengths (predicted speed-up 1.064x)'
        >>> Verdict(Cause.SLOW_WORKERS, "y", action="re-split micro-batches", now="re-arrange topology").action_line()
        're-split micro-batches first; the loss so far has escalated to: re-arrange topology'
        >>> Verdict(Cause.SLOW_WORKERS, "y", action="remove the straggler", recovered_at=30).action_line()
        'none now (recovered at step 30); if it comes back: remove the straggler'
        """  # noqa: E501
        text = self.action
        if self.predicted_speedup is not None:
            text += f" (predicted speed-up {self.predicted_speedup:.3f}x)"
        if self.now not in ("ignore", self.action):
            text += f" first; the loss so far has escalated to: {self.now}"
        if self.recovered_at is not None and self.action != "ignore":
            text = f"none now (recovered at step {self.recovered_at}); if it comes back: {text}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "headline": self.headline,
            "workers": [{"dp": dp, "stage": stage} for dp, stage in self.workers],
            "stage": self.stage,
            "action": self.action,
            "predicted_speedup": self.predicted_speedup,
            "now": self.now,
            "recovered_at": self.recovered_at,
        }


def verdict_of(diagnosis: Diagnosis, recovered_at: int | None = None) -> Verdict:
    """THE verdict of an analysis, from its diagnosis: its cause and summary, the workers
    or stage it names, and the escalation ladder's first fix as the action (the ladder is
    built for the same cause, so the two cannot disagree). `recovered_at`: the step a slow
    episode ended at, when it has."""
    evidence = diagnosis.evidence
    workers: tuple[tuple[int, int], ...] = ()
    # A run's GC pauses are the whole job's; an episode's are one worker's, named.
    if diagnosis.cause in WORKER_CAUSES or (
        diagnosis.cause == Cause.GC_PAUSES and evidence.named_workers
    ):
        named = evidence.named_workers or (
            evidence.figures.mw_workers if evidence.figures is not None else ()
        )
        workers = tuple((w.dp, w.stage) for w in named)
    stage = evidence.finding.stage if diagnosis.cause == Cause.LAST_STAGE_IMBALANCE else None
    ladder = diagnosis.escalation.ladder if diagnosis.escalation is not None else ()
    if len(ladder) > 1:
        action = ladder[1].action
    elif diagnosis.advice and diagnosis.cause != Cause.NONE:
        action = diagnosis.advice[0].action
    else:
        action = "ignore"
    speedup = next((a.predicted_speedup for a in diagnosis.advice if a.action == action), None)
    return Verdict(
        cause=diagnosis.cause,
        headline=diagnosis.summary,
        workers=workers,
        stage=stage,
        action=action,
        predicted_speedup=speedup,
        now=diagnosis.escalation.action if diagnosis.escalation is not None else "ignore",
        recovered_at=recovered_at,
    )


def _seconds(value: float) -> str:
    """Seconds as the ladder speaks of them: whole ones, and a loss under 10 s with the
    decimal it needs (a small job's straggler lost 0.4 s, never "0 s").

    >>> _seconds(1005.2), _seconds(10.5), _seconds(0.43), _seconds(0.0)
    ('1,005 s', '10 s', '0.43 s', '0 s')
    """
    if 0 < value < 10:
        return f"{value:.2g} s"
    return f"{value:,.0f} s"


def escalation_text(escalation: Escalation) -> str:
    """The escalation ladder's step in one line: where the loss so far puts it (past the
    cost of that step), and the next step with the loss at which to take it.

    >>> from lagscope.simulator.evidence import LadderStep
    >>> escalation_text(Escalation(None, 1005.0, "re-arrange topology", None, None,
    ...     (LadderStep("re-arrange topology", 600),)))
    're-arrange topology: 1,005 s of job time lost so far, past the 600 s it costs'

    >>> escalation_text(Escalation(None, 10.5, "ignore", "move layers off the last stage",
    ...     1800.0, ()))
    'ignore for now: 10 s of job time lost so far; next: move layers off the last stage once the loss reaches 1,800 s'
    """  # noqa: E501
    action = escalation.action
    upcoming = escalation.next_action
    now = f"{action} for now" if action == "ignore" and upcoming else action
    text = f"{now}: {_seconds(escalation.accumulated_loss_s)} of job time lost so far"
    cost = next((s.at_loss_s for s in escalation.ladder if s.action == action), 0.0)
    if cost > 0:
        text += f", past the {cost:,.0f} s it costs"
    if upcoming:
        at = escalation.next_action_at_loss_s or 0.0
        text += f"; next: {upcoming} once the loss reaches {at:,.0f} s"
    elif action == "ignore":
        text += " (nothing on the ladder for this cause)"
    return text
