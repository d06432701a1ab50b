"""What runs inside a box: the runner process (``python -m kf.evaluation.runner``), one
class made of its roles (the reference's, the candidate's), the guard over its grading
code, and what those roles use: the device's timing backend, the tensor transports, the
output comparison and the float64 rule, the input variants, the task audit's runner
side and the baselines' settings as a runner applies them.

It imports nothing of :mod:`kf.evaluation.grader`; the two sides share only the wire
(:mod:`kf.evaluation.wire`: the protocol's structs and the values they carry). A test
holds the wall (tests/test_rules.py).
"""
