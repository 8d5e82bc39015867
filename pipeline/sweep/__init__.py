"""Beside the flow: the sweep runs the stages' own commands (a DVC pipeline's chosen stages, each a Ray task with
the CPUs and GPUs its kind needs, on one machine or a cluster) and records them in dvc.lock as `dvc repro` would.
It imports no stage: a stage is a command line here.

May use: common.
"""
