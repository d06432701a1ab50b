"""Devices: their names (:mod:`~kf.devices.names`), the ``--device`` argument and the slots a
worker serves (:mod:`~kf.devices.slots`), the gate that gives a device's timing to one
reader at a time (:mod:`~kf.devices.gate`), what ``nvidia-smi`` says of a GPU
(:mod:`~kf.devices.smi`) and the devices that failed (:mod:`~kf.devices.health`).

Each GPU's runner pool belongs to the grader (:mod:`kf.evaluation.grader.pools`); this
package imports nothing of the evaluation wing, so a runner may read device names.
"""
