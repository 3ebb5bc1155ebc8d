"""Where recorded rows go besides memory: a parquet dataset on disk, TensorBoard, W&B.

    rec = gradscope.Recorder(model, log_dir="runs/exp1", flush_every=100,   # parquet, flat memory
                             sinks=[TensorBoardSink("runs/tb"), WandbSink()])  # live trackers

- :class:`ParquetSink` (``log_dir=``): append-only part files written atomically;
  :func:`read` / ``gradscope.load(dir)`` and :func:`open_dataset` read them back.
- :class:`TensorBoardSink`: every row a scalar ``quantity/site`` at the recorder's step.
- :class:`WandbSink`: every recorded step one ``wandb.log`` of ``quantity/site`` series.
- :class:`Sink`: the interface (``open``, ``begin``, ``append``, ``flush``, ``close``).

TensorBoard and W&B are imported only when their sink is opened.
"""

from gradscope.sinks.base import RunInfo, Sink, series_name
from gradscope.sinks.parquet import SCHEMA, ParquetSink, open_dataset, read
from gradscope.sinks.tensorboard import TensorBoardSink
from gradscope.sinks.wandb import WandbSink

__all__ = ["SCHEMA", "ParquetSink", "RunInfo", "Sink", "TensorBoardSink", "WandbSink", "open_dataset", "read", "series_name"]
