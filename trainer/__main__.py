"""``python -m taskfit [overrides]``: the ``taskfit`` command (taskfit/cli.py), e.g. under torchrun:
``torchrun --nproc-per-node=2 -m taskfit trainer=ddp``."""
from .cli.app import main

# spawned ddp workers re-import this module as __mp_main__: they must not run it
if __name__ == "__main__":
    main()
