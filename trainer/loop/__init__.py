"""The loop's parts: one run of an entry point (``run.py``), the steps (``steps.py``), evaluation
passes (``evaluation.py``), when validation and optimizer steps happen (``cadence.py``), precision,
preemption, hook dispatch (``hooks.py``) and the checks made before work starts (``checks.py``). The
loop itself is the Trainer's, in ``taskfit/trainer.py``."""
