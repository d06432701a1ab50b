"""What kf reads from a task's or a candidate's source, without running it: the task files
(:mod:`~kf.kernels.tasks`) and their shape sets (:mod:`~kf.kernels.tuning`), a candidate's
backend (:mod:`~kf.kernels.backends`), its template parameters (:mod:`~kf.kernels.params`),
its behavioural descriptors (:mod:`~kf.kernels.behaviour`) and its static checks
(:mod:`~kf.kernels.static_checks`, over the call graph of :mod:`~kf.kernels.calls`).

It imports nothing else of kf (tests/test_layers.py holds it), so the runner, the grader,
the agents and the application all read sources the same way.
"""
