"""Long Range Arena on top of the ``attentions`` registry: tasks, model, trainer, benchmarks, tables."""

__version__ = "0.1.0"
