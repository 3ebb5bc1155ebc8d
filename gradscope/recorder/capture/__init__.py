"""What a recorded step reads from the model on the device: the permanent module hooks
(:mod:`.hookset`, :mod:`.site_hooks`), the taps that carry gradient norms out of backward
(:mod:`.taps`, :mod:`.eager`), the device buffers they write (:mod:`.capture`,
:mod:`.store`), the forward signals (:mod:`.signals`), cosine samples, parameter-gradient
norms (:mod:`.params`) and the optimizer's and GradScaler's step (:mod:`.update_ratio`,
:mod:`.scaler_watch`).

Imports :mod:`~gradscope.recorder.numerics` and :mod:`~gradscope.recorder.discovery`.
"""
