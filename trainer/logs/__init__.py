"""What ``self.log`` and the loop's losses become without a host-device sync per call
(``buffer.py``, ``book.py``, ``options.py`` for Lightning's ``self.log`` arguments), the task's
torchmetrics (``metrics.py``) and the ``Logger`` interface every logger implements, with the run
directory it chooses (``logger.py``)."""
