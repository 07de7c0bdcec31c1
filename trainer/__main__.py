"""``python -m trainer [overrides]``: the ``taskfit`` command (trainer/cli.py), e.g. under torchrun:
``torchrun --nproc-per-node=2 -m trainer trainer=ddp``."""
from .cli import main

if __name__ == "__main__":  # spawned ddp workers re-import this module as __mp_main__: they must not run it
    main()
