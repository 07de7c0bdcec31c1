"""The loggers: TensorBoard (``tensorboard.py``, its HParams records in ``tensorboard_hparams.py``),
CSV and MLflow. Each is imported on first use from ``taskfit.callbacks``; the interface is
``logger.py``'s ``Logger`` (``taskfit.callbacks.Logger``)."""
