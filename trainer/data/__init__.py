"""Data plumbing: the resumable sampler, loader limits and re-creation, moving batches
(``loaders.py``), and DataLoader workers that a preemption signal cannot kill (``workers.py``)."""
