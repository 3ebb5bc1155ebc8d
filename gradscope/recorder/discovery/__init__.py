"""Where the recorder looks in any model, found once when a Recorder is made: layer stacks,
sites and their roles, normalisation layers, attention modules, residual sub-layers and
parameter groups (:class:`.layout.Layout`), and the model inside its wrappers.

Imports only :mod:`gradscope.recorder.numerics` of the recorder.
"""
