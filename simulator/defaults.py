"""Defaults of the analysis that the command line shows in `--help` without importing the
analysis itself (numpy and the engine are the larger part of a command's start-up)."""

#: Attribution is reported only when the slowdown reaches this (the reference's default).
DEFAULT_DECOMPOSE_THRESHOLD = 1.03

#: Change-point detection (`simulator.bocd.BocdConfig`): prior probability that a new regime
#: starts at any observation (1 / expected regime length).
BOCD_HAZARD = 1.0 / 250.0
#: Run lengths kept per series; memory and time per update grow with it.
BOCD_MAX_RUN_LENGTH = 100
#: Observations per series that set its location and scale before detection starts.
BOCD_WARMUP = 20
#: A change stands only if the regime means differ by at least this relative amount.
BOCD_MIN_RELATIVE_CHANGE = 0.10

#: The most slices a Perfetto timeline (`analyze --timeline`) holds unless asked for more:
#: at about 190 bytes of JSON a slice, 50 MB. Perfetto's in-browser trace processor has
#: about 2 GB (its documentation) and a trace takes several times its file size there; a
#: 900 MB JSON trace is reported to crash it, and chrome://tracing stopped at 256 MB.
TIMELINE_MAX_SLICES = 250_000
#: DP ranks a timeline window holds when not all of them fit: the slowest and one typical.
TIMELINE_DP_RANKS = 8
#: A timeline window keeps every DP rank when at least this many steps of them fit.
TIMELINE_MIN_STEPS = 4
