"""The Quantity contract (:mod:`.quantity`), what a quantity sees of a step on the device
(:class:`.context.StepContext`) and on the host (:class:`.step_data.StepData`), every
built-in quantity (:mod:`.built_in`, :mod:`.signal_quantities`, :mod:`.spike`) and the
registry of them (:mod:`.registry`).

Imports the parts below it: numerics, discovery, capture.
"""
