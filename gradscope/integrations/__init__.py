"""Optional integrations: HuggingFace Trainer, Lightning, TensorBoard.

Each lives in its own module and imports its framework only when used:
``gradscope.integrations.hf.GradscopeCallback``, ``gradscope.integrations.lightning.GradscopeCallback``,
``gradscope.integrations.tensorboard`` (the live sink is ``gradscope.sinks.TensorBoardSink``).
"""
