"""The grader: what runs in the agent's (or ``kf eval``'s) process and never runs
candidate code. Sessions and stages (compiling, verifying, profiling, counters), the
policy and pipeline over them, the runner pool and each runner's handle, the boxes
runners and builds start in, the builds the grader serves, and the reports.

It imports nothing of :mod:`kf.evaluation.runner`; it talks to runners only in the
messages of :mod:`kf.evaluation.wire.protocol` (tests/test_rules.py holds the wall).
"""
